"""An independent writer of Matrix Studio-style recordings, for the input tests.

It shares no code with dpflow's own sample generator (``dpflow_core.recordings.samples``
and ``dpflow_core.recordings.schemas``): files are written with the plain
``mcap.writer.Writer`` (no mcap-protobuf-support), the protobuf schemas are a
``FileDescriptorSet`` built here by hand from ``descriptor_pb2`` following
formats.md section 1, and messages are serialised with classes made from that
descriptor by ``google.protobuf.message_factory``. The schemas are deliberately
organised differently from dpflow's:

- all ``foxglove`` messages in one ``.proto`` file (``das/foxglove_bundle.proto``),
  the device header in a proto2 file (``arnold/common/header_v2.proto``), plus
  the well-known ``google/protobuf/timestamp.proto``;
- field numbers in another order, the header not first, extra fields a reader
  does not know about;
- the camera schema is ``foxglove.CompressedVideo`` and the IMU schema
  ``foxglove.ImuMeasurement``;
- every message also carries a foxglove-style ``timestamp``
  (``google.protobuf.Timestamp``) holding the host arrival time, which differs
  from the capture time in ``header.timestamp`` by a per-topic delay.

H.264 is encoded with PyAV (libx264), one Annex-B access unit per message,
``format`` = "h264". Episodes go into a dated session layout::

    <root>/vio_result.json
    <root>/<date>/<session>/<STEM>.mcap
    <root>/<date>/<session>/<STEM>_vio.mcap
    <root>/<date>/<session>/<STEM>_vio.json     {"vio": {"state": "Succeeded", ...}, ...}

:func:`write_ros2_bag` writes a ROS 2 bag in MCAP (``ros2msg`` schemas, CDR
messages), which is not a Matrix Studio recording at all.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
from mcap.writer import CompressionType, Writer
from scipy.spatial.transform import Rotation

CAMERA = "/robot0/sensor/camera0/compressed"
CAMERA_INFO = "/robot0/sensor/camera0/camera_info"
IMU = "/robot0/sensor/imu"
GRIPPER = "/robot0/sensor/magnetic_encoder"
POSE = "/robot0/vio/eef_pose"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "uint64": _F.TYPE_UINT64,
    "uint32": _F.TYPE_UINT32,
    "int32": _F.TYPE_INT32,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}
_HEADER_FILE = "arnold/common/header_v2.proto"
_BUNDLE_FILE = "das/foxglove_bundle.proto"
_TIMESTAMP_FILE = "google/protobuf/timestamp.proto"


def _add_message(file: descriptor_pb2.FileDescriptorProto, name: str, fields: list[tuple]) -> None:
    """fields: (number, name, type[, "repeated"]); type is a scalar name or a '.full.Name'."""
    msg = file.message_type.add(name=name)
    for number, fname, ftype, *rest in fields:
        label = _F.LABEL_REPEATED if rest and rest[0] == "repeated" else _F.LABEL_OPTIONAL
        f = msg.field.add(name=fname, number=number, label=label, json_name=fname)
        if ftype in _SCALARS:
            f.type = _SCALARS[ftype]
        else:
            f.type, f.type_name = _F.TYPE_MESSAGE, ftype


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The hand-built schema set (three files), as embedded in every schema record."""
    timestamp = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(timestamp)

    header = descriptor_pb2.FileDescriptorProto(name=_HEADER_FILE, package="arnold.common.proto", syntax="proto2")
    _add_message(header, "Header", [
        (1, "timestamp", "uint64"),
        (2, "sequence_num", "uint64"),
        (3, "module_name", "string"),
        (4, "topic_name", "string"),
        (5, "expect_hz", "double"),
        (6, "inputs", "string", "repeated"),
        (7, "version", "string"),
        (9, "host_id", "string"),          # not in formats.md: a reader must ignore it
    ])

    ts, hdr = ".google.protobuf.Timestamp", ".arnold.common.proto.Header"
    bundle = descriptor_pb2.FileDescriptorProto(
        name=_BUNDLE_FILE, package="foxglove", syntax="proto3", dependency=[_TIMESTAMP_FILE, _HEADER_FILE]
    )
    _add_message(bundle, "Vector3", [(1, "x", "double"), (2, "y", "double"), (3, "z", "double")])
    _add_message(bundle, "Quaternion", [(1, "x", "double"), (2, "y", "double"), (3, "z", "double"), (4, "w", "double")])
    _add_message(bundle, "Pose", [(1, "position", ".foxglove.Vector3"), (2, "orientation", ".foxglove.Quaternion")])
    _add_message(bundle, "CompressedVideo", [
        (1, "timestamp", ts), (2, "frame_id", "string"), (3, "data", "bytes"), (4, "format", "string"),
        (6, "width", "uint32"), (7, "height", "uint32"), (8, "keyframe", "bool"),
        (15, "header", hdr),
    ])
    _add_message(bundle, "CameraCalibration", [
        (1, "timestamp", ts), (9, "frame_id", "string"), (2, "width", "uint32"), (3, "height", "uint32"),
        (4, "distortion_model", "string"), (5, "D", "double", "repeated"), (6, "K", "double", "repeated"),
        (7, "R", "double", "repeated"), (8, "P", "double", "repeated"), (20, "header", hdr),
    ])
    _add_message(bundle, "PoseInFrame", [
        (1, "timestamp", ts), (2, "frame_id", "string"), (3, "pose", ".foxglove.Pose"),
        (16, "header", hdr), (17, "score", "float"), (18, "pose_valid", "bool"),
        (19, "covariance", "double", "repeated"), (20, "tracking_state", "uint32"),
    ])
    _add_message(bundle, "MagneticEncoderMeasurement", [
        (1, "value", "double"), (2, "timestamp", ts), (3, "header", hdr), (4, "raw_counts", "int32"),
    ])
    _add_message(bundle, "ImuMeasurement", [
        (1, "timestamp", ts), (2, "linear_acceleration", ".foxglove.Vector3"),
        (3, "angular_velocity", ".foxglove.Vector3"), (4, "header", hdr), (5, "temperature_c", "float"),
    ])
    return descriptor_pb2.FileDescriptorSet(file=[timestamp, header, bundle])


@lru_cache(maxsize=1)
def message_classes() -> SimpleNamespace:
    """Message classes built from :func:`descriptor_set` in a private pool."""
    pool = descriptor_pool.DescriptorPool()
    for f in descriptor_set().file:
        pool.Add(f)
    names = ["CompressedVideo", "CameraCalibration", "PoseInFrame", "MagneticEncoderMeasurement", "ImuMeasurement"]
    classes = {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"foxglove.{n}")) for n in names}
    return SimpleNamespace(**classes)


# --------------------------------------------------------------------------- scene and H.264


def ground_truth(t_s: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Position (N, 3) m, orientation quaternions (N, 4) xyzw and gripper width (N,) m at ``t_s`` seconds."""
    t = np.asarray(t_s, dtype=np.float64)
    ph = 0.7 * seed
    pos = np.stack([
        0.35 + 0.05 * np.sin(2 * np.pi * 0.4 * t + ph),
        -0.10 + 0.04 * t,
        0.25 + 0.03 * np.cos(2 * np.pi * 0.3 * t + ph),
    ], axis=1)
    rotvec = np.stack([
        0.15 * np.sin(2 * np.pi * 0.25 * t + ph),
        0.10 * t - 0.1,
        0.6 + 0.2 * np.sin(2 * np.pi * 0.2 * t),
    ], axis=1)
    quat = Rotation.from_rotvec(rotvec).as_quat()
    closing = 1.0 / (1.0 + np.exp(-(t - 1.0) * 5.0))
    width = 0.08 - 0.06 * closing
    return pos, quat, width


def render_frame(width: int, height: int, x_m: float, y_m: float, grip_m: float, k: int) -> np.ndarray:
    """(height, width, 3) uint8 RGB: a gradient floor with a square that moves with the camera."""
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[..., 0] = (xx * 255 // max(width - 1, 1)).astype(np.uint8)
    img[..., 1] = (yy * 255 // max(height - 1, 1)).astype(np.uint8)
    img[..., 2] = (k * 37) % 256  # frame identity: a distinct blue level per frame
    cx = int(width / 2 + (x_m - 0.35) * width * 4)
    cy = int(height / 2 + (y_m + 0.05) * height * 4)
    s = max(4, int(grip_m * 150))
    img[max(cy - s, 0):max(cy + s, 0), max(cx - s, 0):max(cx + s, 0)] = (250, 240, 30)
    return img


def encode_h264(frames_rgb: list[np.ndarray], fps: int, gop: int) -> list[bytes]:
    """Encode RGB frames with libx264 into Annex-B access units, exactly one per frame."""
    h, w = frames_rgb[0].shape[:2]
    enc = av.CodecContext.create("libx264", "w")
    enc.width, enc.height, enc.pix_fmt = w, h, "yuv420p"
    enc.time_base = Fraction(1, fps)
    enc.framerate = Fraction(fps, 1)
    enc.options = {"preset": "veryfast", "tune": "zerolatency", "x264-params": f"keyint={gop}:bframes=0:scenecut=0"}
    units: list[bytes] = []
    for k, img in enumerate(frames_rgb):
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = k
        units += [bytes(p) for p in enc.encode(frame)]
    units += [bytes(p) for p in enc.encode(None)]
    assert len(units) == len(frames_rgb), (len(units), len(frames_rgb))
    assert units[0].startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01")), "expected Annex-B output"
    return units


# --------------------------------------------------------------------------- MCAP writing


@dataclass
class ForeignEpisode:
    """Ground truth of one written episode (capture times in ns, positions in m)."""

    stem: str
    folder: Path
    raw_mcap: Path
    vio_mcap: Path
    vio_json: Path
    fps: int
    camera_ts_ns: np.ndarray      # (N,) int64
    position_m: np.ndarray        # (N, 3) at camera_ts_ns
    quat_xyzw: np.ndarray         # (N, 4) at camera_ts_ns
    gripper_ts_ns: np.ndarray     # (G,) int64
    gripper_width_m: np.ndarray   # (G,)
    t0_ns: int                    # clock origin of ground_truth()
    seed: int

    def truth_at(self, ts_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """True position (m), quaternion (xyzw) and gripper width (m) at capture times ``ts_ns``."""
        return ground_truth((np.asarray(ts_ns, dtype=np.int64) - self.t0_ns) / 1e9, self.seed)


def _stamp(ns: int) -> dict:
    """A ``google.protobuf.Timestamp`` as constructor keywords (the classes live in a private pool)."""
    return {"seconds": ns // 1_000_000_000, "nanos": ns % 1_000_000_000}


def _header(topic: str, seq: int, ts_ns: int, hz: float, inputs=()) -> dict:
    return dict(timestamp=int(ts_ns), sequence_num=seq, module_name=topic.split("/")[-2], topic_name=topic,
                expect_hz=float(hz), inputs=list(inputs), version="ms-3.1.0", host_id="das-07")


class _Mcap:
    """Plain ``mcap.writer.Writer`` with lazily registered protobuf schemas and channels."""

    def __init__(self, f, fds: bytes, compression: CompressionType, chunk_size: int):
        self.w = Writer(f, chunk_size=chunk_size, compression=compression)
        self.w.start(profile="", library="foreign-writer/0.1")
        self.fds = fds
        self.schemas: dict[str, int] = {}
        self.channels: dict[str, int] = {}

    def write(self, topic: str, msg, log_time: int, publish_time: int) -> None:
        name = msg.DESCRIPTOR.full_name
        if name not in self.schemas:
            self.schemas[name] = self.w.register_schema(name=name, encoding="protobuf", data=self.fds)
        if topic not in self.channels:
            self.channels[topic] = self.w.register_channel(
                topic=topic, message_encoding="protobuf", schema_id=self.schemas[name], metadata={"origin": "das"}
            )
        self.w.add_message(self.channels[topic], log_time=log_time, data=msg.SerializeToString(),
                           publish_time=publish_time, sequence=0)

    def finish(self) -> None:
        self.w.finish()


def write_foreign_episode(
    folder: str | Path,
    stem: str,
    seed: int = 0,
    seconds: float = 2.5,
    fps: int = 20,
    size: tuple[int, int] = (96, 64),
    compression: CompressionType = CompressionType.LZ4,
    chunk_size: int = 64 * 1024,
    status: dict | None = None,
) -> ForeignEpisode:
    """Write ``<STEM>.mcap``, ``<STEM>_vio.mcap`` and ``<STEM>_vio.json`` into ``folder``.

    Camera and VIO pose at ``fps`` Hz (the pose at each frame's capture time),
    gripper at 50 Hz starting before and ending after the camera, IMU at 100 Hz.
    The capture clock has a small jitter; arrival (log) times trail capture by a
    per-topic delay, so files are not in capture-time order across topics.
    """
    m = message_classes()
    rng = np.random.default_rng(100 + seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = 1_795_000_000_000_000_000 + seed * 7_200_000_000_000
    w, h = size

    n = int(round(seconds * fps))
    cam_ns = t0 + np.round(np.arange(n) * 1e9 / fps + rng.uniform(-2e5, 2e5, n)).astype(np.int64)
    t_s = (cam_ns - t0) / 1e9
    pos, quat, width = ground_truth(t_s, seed)
    units = encode_h264([render_frame(w, h, pos[k, 0], pos[k, 1], width[k], k) for k in range(n)], fps, gop=fps)

    g_ns = t0 - 30_000_000 + np.arange(int((seconds + 0.1) * 50)) * 20_000_000
    g_width = ground_truth((g_ns - t0) / 1e9, seed)[2]
    i_ns = t0 - 15_000_000 + np.arange(int(seconds * 100)) * 10_000_000

    raw: list[tuple[int, int, str, object]] = []  # (log_time, capture_time, topic, message)
    for k in range(n):
        ts = int(cam_ns[k])
        arrive = ts + 12_000_000 + int(rng.integers(0, 4_000_000))
        raw.append((arrive, ts, CAMERA, m.CompressedVideo(
            timestamp=_stamp(arrive), frame_id="cam0_optical", data=units[k], format="h264",
            width=w, height=h, keyframe=k % fps == 0, header=_header(CAMERA, k, ts, fps))))
        raw.append((arrive + 500_000, ts, CAMERA_INFO, m.CameraCalibration(
            timestamp=_stamp(arrive), frame_id="cam0_optical", width=w, height=h, distortion_model="equidistant",
            D=[0.01, -0.002, 0.0, 0.0], K=[w * 0.5, 0.0, w / 2, 0.0, w * 0.5, h / 2, 0.0, 0.0, 1.0],
            header=_header(CAMERA_INFO, k, ts, fps))))
    for k, ts in enumerate(int(x) for x in g_ns):
        arrive = ts + 3_000_000
        raw.append((arrive, ts, GRIPPER, m.MagneticEncoderMeasurement(
            value=float(g_width[k]), timestamp=_stamp(arrive), header=_header(GRIPPER, k, ts, 50),
            raw_counts=int(g_width[k] * 1e5))))
    for k, ts in enumerate(int(x) for x in i_ns):
        arrive = ts + 1_000_000
        raw.append((arrive, ts, IMU, m.ImuMeasurement(
            timestamp=_stamp(arrive), header=_header(IMU, k, ts, 100), temperature_c=31.5,
            linear_acceleration=dict(x=0.0, y=0.1, z=9.81), angular_velocity=dict(x=0.01, y=0.0, z=-0.02))))
    poses = []
    for k in range(n):
        ts = int(cam_ns[k])
        arrive = ts + 45_000_000
        p = m.PoseInFrame(timestamp=_stamp(arrive), frame_id="vio_world", header=_header(POSE, k, ts, fps, [f"{CAMERA}:{k}"]),
                          score=0.9, pose_valid=True, covariance=[1e-4] * 6, tracking_state=2)
        p.pose.position.x, p.pose.position.y, p.pose.position.z = (float(v) for v in pos[k])
        p.pose.orientation.x, p.pose.orientation.y, p.pose.orientation.z, p.pose.orientation.w = (float(v) for v in quat[k])
        poses.append((arrive, ts, POSE, p))

    fds = descriptor_set().SerializeToString()
    raw_path, vio_path, json_path = folder / f"{stem}.mcap", folder / f"{stem}_vio.mcap", folder / f"{stem}_vio.json"
    for path, records in ((raw_path, raw), (vio_path, raw + poses)):
        with open(path, "wb") as f:
            out = _Mcap(f, fds, compression, chunk_size)
            for log_time, capture, topic, msg in sorted(records, key=lambda r: r[0]):
                out.write(topic, msg, log_time, capture)
            out.finish()
    doc = status if status is not None else {
        "file": raw_path.name,
        "vio": {"state": "Succeeded", "tracked_frames": n, "lost_frames": 0, "mean_score": 0.9},
        "software": {"name": "MatrixStudio", "version": "3.1.0"},
    }
    json_path.write_text(json.dumps(doc, indent=1))
    return ForeignEpisode(stem, folder, raw_path, vio_path, json_path, fps, cam_ns, pos, quat, g_ns, g_width, t0, seed)


def write_foreign_task(root: str | Path, task: str = "cup_stack", episodes: int = 2, **kwargs) -> list[ForeignEpisode]:
    """Write ``episodes`` episodes into ``<root>/2026-11-29/session_<A, B, ...>/`` and ``<root>/vio_result.json``.

    Episodes alternate LZ4-compressed and uncompressed chunks.
    """
    root = Path(root)
    written = []
    for k in range(episodes):
        folder = root / "2026-11-29" / f"session_{chr(ord('A') + k)}"
        stem = f"DAS07_20261129_{10 + k:02d}1500"
        compression = CompressionType.LZ4 if k % 2 == 0 else CompressionType.NONE
        written.append(write_foreign_episode(folder, stem, seed=k, compression=compression, **kwargs))
    summary = {
        "task_name": task,
        "matrix_studio_version": "3.1.0",
        "success_mcap_files": [str(e.raw_mcap.relative_to(root)) for e in written],
        "failed_mcap_files": [],
    }
    (root / "vio_result.json").write_text(json.dumps(summary, indent=1))
    return written


def explicit_manifest(root: str | Path, episodes: list[ForeignEpisode]) -> dict:
    """The explicit pairing document for ``episodes`` (paths relative to ``root``)."""
    root = Path(root)
    return {"episodes": [
        {"stem": e.stem, "raw_mcap": str(e.raw_mcap.relative_to(root)), "vio_mcap": str(e.vio_mcap.relative_to(root)),
         "vio_json": str(e.vio_json.relative_to(root))}
        for e in episodes
    ]}


# --------------------------------------------------------------------------- ROS 2 bag


class _Cdr:
    """Little-endian XCDR1 serialisation of a few ROS 2 field types (alignment from the payload start)."""

    def __init__(self):
        self.buf = bytearray(b"\x00\x01\x00\x00")  # encapsulation header: CDR_LE

    def _align(self, n: int) -> None:
        self.buf += b"\x00" * ((-(len(self.buf) - 4)) % n)

    def prim(self, fmt: str, *values) -> "_Cdr":
        size = struct.calcsize("<" + fmt.lstrip("0123456789")[0])
        self._align(size)
        self.buf += struct.pack("<" + fmt, *values)
        return self

    def string(self, s: str) -> "_Cdr":
        data = s.encode() + b"\x00"
        self.prim("I", len(data))
        self.buf += data
        return self

    def octets(self, data: bytes) -> "_Cdr":
        self.prim("I", len(data))
        self.buf += data
        return self

    def stamp(self, ns: int, frame_id: str) -> "_Cdr":
        return self.prim("iI", ns // 1_000_000_000, ns % 1_000_000_000).string(frame_id)


_ROS_DEFS = {
    "tf2_msgs/msg/TFMessage": "geometry_msgs/TransformStamped[] transforms\n",
    "sensor_msgs/msg/CompressedImage": "std_msgs/Header header\nstring format\nuint8[] data\n",
    "sensor_msgs/msg/Imu": "std_msgs/Header header\ngeometry_msgs/Quaternion orientation\n"
                           "float64[9] orientation_covariance\ngeometry_msgs/Vector3 angular_velocity\n"
                           "float64[9] angular_velocity_covariance\ngeometry_msgs/Vector3 linear_acceleration\n"
                           "float64[9] linear_acceleration_covariance\n",
}


def write_ros2_bag(path: str | Path, seconds: float = 1.0) -> Path:
    """Write a small ROS 2 bag in MCAP: /tf, /camera/image_raw/compressed and /imu (ros2msg + CDR)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = 1_700_000_000_000_000_000
    with open(path, "wb") as f:
        w = Writer(f, compression=CompressionType.ZSTD)
        w.start(profile="ros2", library="rosbag2-like")
        sid = {name: w.register_schema(name=name, encoding="ros2msg", data=text.encode()) for name, text in _ROS_DEFS.items()}
        ch = {
            "/tf": w.register_channel("/tf", "cdr", sid["tf2_msgs/msg/TFMessage"], {"offered_qos_profiles": ""}),
            "/camera/image_raw/compressed": w.register_channel(
                "/camera/image_raw/compressed", "cdr", sid["sensor_msgs/msg/CompressedImage"], {"offered_qos_profiles": ""}),
            "/imu": w.register_channel("/imu", "cdr", sid["sensor_msgs/msg/Imu"], {"offered_qos_profiles": ""}),
        }
        records = []
        for k in range(int(seconds * 10)):
            ts = t0 + k * 100_000_000
            tf = _Cdr().prim("I", 1).stamp(ts, "odom").string("base_link").prim("ddd", 0.1 * k, 0.0, 0.0).prim("dddd", 0, 0, 0, 1)
            records.append((ts, ch["/tf"], tf))
            img = _Cdr().stamp(ts, "camera").string("jpeg").octets(b"\xff\xd8\xff\xe0" + bytes(60) + b"\xff\xd9")
            records.append((ts + 1, ch["/camera/image_raw/compressed"], img))
        for k in range(int(seconds * 100)):
            ts = t0 + k * 10_000_000
            imu = _Cdr().stamp(ts, "imu").prim("dddd", 0, 0, 0, 1).prim("9d", *[0.0] * 9).prim("ddd", 0, 0, 0.01)
            imu.prim("9d", *[0.0] * 9).prim("ddd", 0, 0, 9.81).prim("9d", *[0.0] * 9)
            records.append((ts + 2, ch["/imu"], imu))
        for ts, cid, msg in sorted(records, key=lambda r: r[0]):
            w.add_message(cid, log_time=ts, data=bytes(msg.buf), publish_time=ts)
        w.finish()
    return path
