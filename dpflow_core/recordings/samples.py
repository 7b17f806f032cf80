"""Sample Matrix Studio recordings: the demo input and the test fixture generator.

Writes a task folder as Matrix Studio does (formats.md section 1)::

    <task>/<STEM>.mcap        camera (H.264), camera_info, IMU, gripper width
    <task>/<STEM>_vio.mcap    the same plus the VIO pose track
    <task>/<STEM>_vio.json    per-file VIO status
    <task>/vio_result.json    {"success_mcap_files": [...], "failed_mcap_files": [...]}

The scene is a textured table with objects seen by a camera that follows a
smooth 6-DoF trajectory, with a gripper whose fingers open and close; frames are
encoded to H.264 Annex-B with PyAV (libx264), one access unit per message.
Timestamps carry realistic jitter and arrival delays (``log_time`` =
``header.timestamp`` + delay). Output is deterministic for a given seed.

Faults used by the tests (late camera, leading P-frames, pose messages out of
log-time order, VIO dropouts, missing frames, a failed status) are options of
:class:`SampleSpec`; byte-level damage (truncation, corruption) is done by the
tests on the written files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable

import av
import cv2
import numpy as np
from mcap_protobuf.writer import Writer
from scipy.spatial.transform import Rotation

from dpflow_core.files import atomic_output, write_text_atomic
from dpflow_core.recordings.schemas import das_messages
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap

#: Capture clock of the first sample episode (ns since the Unix epoch).
_EPOCH_NS = 1_767_000_000_000_000_000


@dataclass(frozen=True)
class SampleSpec:
    """How one sample episode is recorded.

    Attributes:
        seconds: recording length in seconds (all streams, before faults).
        fps: camera and VIO rate in Hz (nominal 30).
        width, height: camera resolution in pixels.
        gop_size: frames between IDR (key) frames.
        gripper_hz, imu_hz: rates of the gripper encoder and IMU in Hz.
        camera_start_delay_s: camera starts this many seconds after the other streams.
        camera_end_early_s: camera stops this many seconds before the other streams.
        drop_first_idr: drop the first IDR access unit, so the stream starts with
            P-frames that cannot be decoded until the next IDR.
        missing_frames: camera frame indices that are not written (dropped frames).
        pose_out_of_order: number of adjacent pose-message pairs written with
            swapped log times (arrival order inverted).
        pose_invalid: (start_s, end_s) spans where ``pose_valid`` is false.
        vio_coverage: (start_fraction, end_fraction) of the episode covered by the
            pose track (VIO that started late or stopped early).
        vio_status: the ``status`` written to ``<STEM>_vio.json``.
    """

    seconds: float = 8.0
    fps: float = 30.0
    width: int = 320
    height: int = 240
    gop_size: int = 30
    gripper_hz: float = 50.0
    imu_hz: float = 200.0
    camera_start_delay_s: float = 0.0
    camera_end_early_s: float = 0.0
    drop_first_idr: bool = False
    missing_frames: tuple[int, ...] = ()
    pose_out_of_order: int = 0
    pose_invalid: tuple[tuple[float, float], ...] = ()
    vio_coverage: tuple[float, float] = (0.0, 1.0)
    vio_status: str = "success"
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SampleEpisode:
    """Paths and ground truth of one written sample episode.

    Attributes:
        stem: the file stem.
        raw_mcap, vio_mcap, vio_json: the written files.
        camera_ts_ns: (N,) uint64 capture times of the camera frames written.
        pose_ts_ns: (M,) uint64 capture times of the pose messages.
        position_m: (M,) x 3 float64 true camera positions at ``pose_ts_ns``.
        quat_xyzw: (M, 4) float64 true orientations at ``pose_ts_ns``.
        gripper_ts_ns: (G,) uint64; gripper_width_m: (G,) float64 metres.
    """

    stem: str
    raw_mcap: Path
    vio_mcap: Path
    vio_json: Path
    camera_ts_ns: np.ndarray
    pose_ts_ns: np.ndarray
    position_m: np.ndarray
    quat_xyzw: np.ndarray
    gripper_ts_ns: np.ndarray
    gripper_width_m: np.ndarray


def trajectory(t_s: np.ndarray, rng_seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Smooth ground-truth motion of an episode.

    Args:
        t_s: (N,) float64 seconds from the episode start.
        rng_seed: seed of the episode's random phases and amplitudes.

    Returns:
        position (N, 3) float64 metres, rotation vector (N, 3) float64 radians
        (norm well below pi), gripper width (N,) float64 metres in [0.01, 0.09].
    """
    rng = np.random.default_rng(rng_seed)
    t = np.asarray(t_s, dtype=np.float64)[:, None]
    freqs = rng.uniform(0.05, 0.35, size=(3, 3))
    phases = rng.uniform(0, 2 * np.pi, size=(3, 3))
    amp_pos = rng.uniform(0.03, 0.12, size=(3, 3))
    amp_rot = rng.uniform(0.05, 0.25, size=(3, 3))
    base = np.array([0.4, 0.0, 0.3]) + rng.uniform(-0.05, 0.05, 3)
    pos = base + sum(amp_pos[k] * np.sin(2 * np.pi * freqs[k] * t + phases[k]) for k in range(3))
    rot = sum(amp_rot[k] * np.sin(2 * np.pi * freqs[k] * t + phases[k] + 1.0) for k in range(3))
    duration = max(float(t_s[-1]) if len(t_s) else 1.0, 1e-3)
    close_at, open_at = rng.uniform(0.25, 0.4) * duration, rng.uniform(0.65, 0.8) * duration
    ts = t[:, 0]
    closing = 1 / (1 + np.exp(-(ts - close_at) * 6)) - 1 / (1 + np.exp(-(ts - open_at) * 6))
    width = 0.085 - 0.07 * closing
    return pos, rot, width


class _Scene:
    """A textured table with objects, viewed through a moving camera."""

    def __init__(self, width: int, height: int, seed: int):
        rng = np.random.default_rng(seed)
        size = (height * 3, width * 3)
        ys, xs = np.mgrid[0 : size[0], 0 : size[1]].astype(np.float32)
        wood = 0.5 + 0.25 * np.sin(xs / 17.0 + 3 * np.sin(ys / 41.0)) + 0.1 * rng.standard_normal(size)
        world = np.stack([40 + 30 * wood, 60 + 50 * wood, 90 + 70 * wood], axis=-1)  # BGR: wood
        for _ in range(45):
            color = rng.integers(30, 255, 3).tolist()
            cx, cy = int(rng.integers(0, size[1])), int(rng.integers(0, size[0]))
            if rng.random() < 0.5:
                cv2.circle(world, (cx, cy), int(rng.integers(8, 40)), color, -1, cv2.LINE_AA)
            else:
                w, h = int(rng.integers(15, 60)), int(rng.integers(15, 60))
                cv2.rectangle(world, (cx, cy), (cx + w, cy + h), color, -1, cv2.LINE_AA)
        self.world = np.clip(world, 0, 255).astype(np.uint8)
        self.width, self.height = width, height
        self.rng = rng

    def render(self, pos_m: np.ndarray, rotvec: np.ndarray, gripper_m: float) -> np.ndarray:
        """(height, width, 3) uint8 BGR frame for a camera pose and gripper width."""
        cx, cy = self.world.shape[1] / 2, self.world.shape[0] / 2
        px_per_m = self.width * 2.5
        scale = 0.3 / max(pos_m[2], 0.05)
        angle = np.degrees(rotvec[2])
        m = cv2.getRotationMatrix2D((cx + pos_m[1] * px_per_m, cy + (pos_m[0] - 0.4) * px_per_m), angle, scale)
        m[:, 2] += np.array([self.width / 2 - cx, self.height / 2 - cy])
        frame = cv2.warpAffine(self.world, m, (self.width, self.height), borderMode=cv2.BORDER_REFLECT)
        gap = int(gripper_m / 0.09 * self.width * 0.3)
        fw, fh = self.width // 10, self.height // 3
        mid = self.width // 2
        cv2.rectangle(frame, (mid - gap - fw, self.height - fh), (mid - gap, self.height), (40, 40, 40), -1)
        cv2.rectangle(frame, (mid + gap, self.height - fh), (mid + gap + fw, self.height), (40, 40, 40), -1)
        noise = self.rng.integers(-3, 4, frame.shape, dtype=np.int16)
        return np.clip(frame.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def encode_h264(frames_bgr: list[np.ndarray], fps: float, gop_size: int) -> list[tuple[bytes, bool]]:
    """Encode frames to H.264 Annex-B access units, one per frame: [(bytes, is_keyframe)]."""
    h, w = frames_bgr[0].shape[:2]
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height = w, h
    ctx.pix_fmt = "yuv420p"
    ctx.time_base = Fraction(1, int(round(fps)))
    ctx.framerate = Fraction(int(round(fps)), 1)
    ctx.gop_size = gop_size
    ctx.max_b_frames = 0
    ctx.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": "23", "x264-params": f"keyint={gop_size}:min-keyint={gop_size}:scenecut=0"}
    out: list[tuple[bytes, bool]] = []
    for i, img in enumerate(frames_bgr):
        frame = av.VideoFrame.from_ndarray(img, format="bgr24").reformat(format="yuv420p")
        frame.pts = i
        out.extend((bytes(p), bool(p.is_keyframe)) for p in ctx.encode(frame))
    out.extend((bytes(p), bool(p.is_keyframe)) for p in ctx.encode(None))
    if len(out) != len(frames_bgr):
        raise RuntimeError(f"encoder produced {len(out)} access units for {len(frames_bgr)} frames")
    return out


def device_header(msgs, topic: str, seq: int, ts_ns: int, hz: float, inputs: tuple[str, ...] = ()):
    return msgs.Header(
        module_name=topic.strip("/").split("/")[-2] if topic.count("/") > 1 else topic,
        sequence_num=seq,
        timestamp=int(ts_ns),
        topic_name=topic,
        expect_hz=hz,
        inputs=list(inputs),
        version="dpflow-sample-1",
    )


def write_episode(
    task_dir: str | Path,
    stem: str,
    spec: SampleSpec = SampleSpec(),
    seed: int = 0,
    topics: TopicMap = DAS_DEFAULT,
) -> SampleEpisode:
    """Write one episode's ``<STEM>.mcap``, ``<STEM>_vio.mcap`` and ``<STEM>_vio.json``.

    Args:
        task_dir: the task folder (created if missing).
        stem: file stem; the three files are named from it.
        spec: recording parameters and faults.
        seed: random seed (scene, trajectory, jitter).
        topics: topic names to write.

    Returns:
        The written paths and the ground truth of the recording.
    """
    rng = np.random.default_rng(seed)
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    t0 = _EPOCH_NS + seed * 3_600_000_000_000 + int(rng.integers(0, 10**9))
    period_ns = 1e9 / spec.fps

    n_frames = int(round(spec.seconds * spec.fps))
    frame_t_ns = t0 + np.round(np.arange(n_frames) * period_ns + rng.normal(0, 3e5, n_frames)).astype(np.int64)
    frame_t_ns = np.maximum.accumulate(frame_t_ns)
    t_s = (frame_t_ns - t0) / 1e9
    pos, rotvec, width = trajectory(t_s, seed)
    quat = Rotation.from_rotvec(rotvec).as_quat()

    scene = _Scene(spec.width, spec.height, seed)
    cam_keep = (t_s >= spec.camera_start_delay_s) & (t_s <= spec.seconds - spec.camera_end_early_s - 0.5 / spec.fps)
    cam_idx = [i for i in np.flatnonzero(cam_keep) if i not in set(spec.missing_frames)]
    frames = [scene.render(pos[i], rotvec[i], width[i]) for i in cam_idx]
    units = encode_h264(frames, spec.fps, spec.gop_size) if frames else []
    camera = list(zip(cam_idx, units))
    if spec.drop_first_idr and camera:
        camera = camera[1:]

    lo, hi = spec.vio_coverage
    pose_idx = np.flatnonzero((t_s >= lo * spec.seconds) & (t_s <= hi * spec.seconds))

    g_n = int(spec.seconds * spec.gripper_hz)
    g_t_ns = t0 + np.round(np.arange(g_n) * 1e9 / spec.gripper_hz + rng.normal(0, 2e5, g_n)).astype(np.int64) - 7_000_000
    g_t_ns = np.maximum.accumulate(g_t_ns)
    g_width = np.interp((g_t_ns - t0) / 1e9, t_s, width) + rng.normal(0, 2e-4, g_n)
    i_n = int(spec.seconds * spec.imu_hz)
    i_t_ns = t0 + np.round(np.arange(i_n) * 1e9 / spec.imu_hz).astype(np.int64) - 11_000_000

    pose_valid = np.array([not any(a <= t_s[i] < b for a, b in spec.pose_invalid) for i in pose_idx], dtype=bool)
    camera_ts = np.array([frame_t_ns[i] for i, _ in camera], dtype=np.int64)
    raw_path, vio_path, json_path = write_recording(task_dir, stem, rng, spec, topics, EpisodeStreams(
        camera_ts_ns=camera_ts, access_units=[u for _, (u, _k) in camera],
        gripper_ts_ns=g_t_ns, gripper_width_m=g_width, imu_ts_ns=i_t_ns, imu=None,
        pose_ts_ns=frame_t_ns[pose_idx], position_m=pos[pose_idx], quat_xyzw=quat[pose_idx], pose_valid=pose_valid,
    ))
    return SampleEpisode(
        stem=stem,
        raw_mcap=raw_path,
        vio_mcap=vio_path,
        vio_json=json_path,
        camera_ts_ns=np.array([frame_t_ns[i] for i, _ in camera], dtype=np.uint64),
        pose_ts_ns=frame_t_ns[pose_idx].astype(np.uint64),
        position_m=pos[pose_idx],
        quat_xyzw=quat[pose_idx],
        gripper_ts_ns=g_t_ns.astype(np.uint64),
        gripper_width_m=g_width,
    )


@dataclass(frozen=True)
class EpisodeStreams:
    """The sampled streams of one episode, each with its own capture times (int64 ns): camera frames
    (``access_units``: one H.264 Annex-B access unit per frame), gripper widths (m), IMU readings (``imu``:
    ``(gyro (I, 3) rad/s, accel (I, 3) m/s^2)`` in the device frame, or None for sensor noise only), and the
    VIO pose track (``position_m`` (P, 3), ``quat_xyzw`` (P, 4), ``pose_valid`` (P,) bool)."""

    camera_ts_ns: np.ndarray
    access_units: list
    gripper_ts_ns: np.ndarray
    gripper_width_m: np.ndarray
    imu_ts_ns: np.ndarray
    imu: tuple | None
    pose_ts_ns: np.ndarray
    position_m: np.ndarray
    quat_xyzw: np.ndarray
    pose_valid: np.ndarray


def write_recording(task_dir: Path, stem: str, rng: np.random.Generator, spec: SampleSpec, topics: TopicMap,
                    streams: EpisodeStreams) -> tuple[Path, Path, Path]:
    """Write the sampled streams of one episode as Matrix Studio does: ``<STEM>.mcap``, ``<STEM>_vio.mcap``
    (the same plus the pose track) and ``<STEM>_vio.json``; returns their paths.

    Every stream of ``streams`` (:class:`EpisodeStreams`) keeps its own capture times (in the header);
    ``log_time`` adds an arrival delay drawn from ``rng`` (the random-motion samples have no consistent IMU). ``spec`` gives the rates, the image
    size of ``camera_info``, ``pose_out_of_order`` and ``vio_status``.
    """
    camera_ts_ns, access_units, gripper_ts_ns, gripper_width_m = (
        streams.camera_ts_ns, streams.access_units, streams.gripper_ts_ns, streams.gripper_width_m)
    imu_ts_ns, imu, pose_ts_ns, position_m, quat_xyzw, pose_valid = (
        streams.imu_ts_ns, streams.imu, streams.pose_ts_ns, streams.position_m, streams.quat_xyzw, streams.pose_valid)
    msgs = das_messages()
    raw: list[tuple[int, str, object]] = []
    for seq, (ts, data) in enumerate(zip(camera_ts_ns, access_units)):
        ts = int(ts)
        raw.append((ts + int(rng.integers(8, 25)) * 1_000_000, topics.camera,
                    msgs.CompressedImage(header=device_header(msgs, topics.camera, seq, ts, spec.fps),
                                         frame_id="camera0", data=data, format="h264")))
        if topics.camera_info:
            raw.append((ts + 1_000_000, topics.camera_info,
                        msgs.CameraCalibration(header=device_header(msgs, topics.camera_info, seq, ts, spec.fps),
                                               frame_id="camera0", width=spec.width, height=spec.height,
                                               distortion_model="kannala_brandt",
                                               D=[-0.01, 0.002, 0.0, 0.0],
                                               K=[spec.width * 0.45, 0, spec.width / 2, 0, spec.width * 0.45, spec.height / 2, 0, 0, 1])))
    for seq, (ts, w) in enumerate(zip(gripper_ts_ns, gripper_width_m)):
        raw.append((int(ts) + int(rng.integers(1, 5)) * 1_000_000, topics.gripper,
                    msgs.MagneticEncoderMeasurement(header=device_header(msgs, topics.gripper, seq, ts, spec.gripper_hz), value=float(w))))
    i_n = len(imu_ts_ns)
    if imu is None:
        gyro = rng.normal(0, 0.02, (i_n, 3))
        acc = rng.normal(0, 0.05, (i_n, 3)) + np.array([0, 0, 9.81])
    else:
        gyro, acc = imu
    for seq, ts in enumerate(imu_ts_ns):
        raw.append((int(ts) + 2_000_000, topics.imu,
                    msgs.Imu(header=device_header(msgs, topics.imu, seq, ts, spec.imu_hz),
                             angular_velocity=dict(zip("xyz", gyro[seq])), linear_acceleration=dict(zip("xyz", acc[seq])))))

    pose_msgs: list[tuple[int, str, object]] = []
    for seq, (ts, valid) in enumerate(zip(pose_ts_ns, pose_valid)):
        ts, valid = int(ts), bool(valid)
        score = float(np.clip(rng.normal(0.92, 0.03), 0, 1)) if valid else float(rng.uniform(0.0, 0.3))
        p = msgs.PoseInFrame(header=device_header(msgs, topics.pose, seq, ts, spec.fps, (f"{topics.camera}#{seq}",)),
                             frame_id="world", pose_valid=valid, score=score)
        p.pose.position.x, p.pose.position.y, p.pose.position.z = position_m[seq]
        p.pose.orientation.x, p.pose.orientation.y, p.pose.orientation.z, p.pose.orientation.w = quat_xyzw[seq]
        pose_msgs.append((ts + int(rng.integers(30, 45)) * 1_000_000, topics.pose, p))

    raw.sort(key=lambda r: r[0])
    vio = sorted(raw + pose_msgs, key=lambda r: r[0])
    if spec.pose_out_of_order:
        pose_positions = [k for k, r in enumerate(vio) if r[1] == topics.pose]
        for k in pose_positions[5 : 5 + 6 * spec.pose_out_of_order : 6]:
            nxt = next(j for j in pose_positions if j > k)
            vio[k], vio[nxt] = vio[nxt], vio[k]

    raw_path, vio_path, json_path = (task_dir / f"{stem}.mcap", task_dir / f"{stem}_vio.mcap", task_dir / f"{stem}_vio.json")
    for path, records in ((raw_path, raw), (vio_path, vio)):
        write_mcap(path, records)
    status = {
        "status": spec.vio_status,
        "input_file": raw_path.name,
        "output_file": vio_path.name,
        "frame_count": len(access_units),
        "pose_count": len(pose_msgs),
        "valid_pose_ratio": round(float(np.mean([m[2].pose_valid for m in pose_msgs])) if pose_msgs else 0.0, 4),
        "vio_version": "sample-1.0",
    }
    write_text_atomic(json_path, json.dumps(status, indent=2))
    return raw_path, vio_path, json_path


def write_mcap(path: Path, records: list[tuple[int, str, object]]) -> None:
    with atomic_output(path, "wb") as f:
        writer = Writer(f)
        for log_time, topic, msg in records:
            writer.write_message(topic, msg, log_time=log_time, publish_time=msg.header.timestamp)
        writer.finish()


def write_task(
    out_dir: str | Path,
    episodes: int = 6,
    seconds: float = 8.0,
    seed: int = 0,
    task: str = "pick_place",
    spec: SampleSpec = SampleSpec(),
    topics: TopicMap = DAS_DEFAULT,
    progress: Callable[[int, int], None] | None = None,
) -> list[SampleEpisode]:
    """Write a Matrix Studio task folder ``out_dir/<task>/`` with ``episodes`` episodes.

    Episode ``k`` uses seed ``seed * 1000 + k`` and length ``seconds`` +- 15 %.
    ``vio_result.json`` lists the episodes whose status is success.
    ``progress(done, total)`` is called after each episode.

    Raises:
        FileExistsError: when ``out_dir/<task>`` already holds recordings.
    """
    task_dir = Path(out_dir) / task
    if task_dir.exists() and any(task_dir.glob("*.mcap")):
        raise FileExistsError(f"{task_dir}: already holds recordings; choose an empty folder")
    rng = np.random.default_rng(seed)
    written = []
    for k in range(episodes):
        length = float(seconds * rng.uniform(0.85, 1.15))
        written.append(write_episode(task_dir, f"{task}_{k:04d}", replace(spec, seconds=length), seed * 1000 + k, topics))
        if progress is not None:
            progress(k + 1, episodes)
    summary = {
        "task_name": task,
        "success_mcap_files": [e.vio_mcap.name for e in written if json.loads(e.vio_json.read_text())["status"] == "success"],
        "failed_mcap_files": [e.raw_mcap.name for e in written if json.loads(e.vio_json.read_text())["status"] != "success"],
    }
    write_text_atomic(task_dir / "vio_result.json", json.dumps(summary, indent=2))
    return written
