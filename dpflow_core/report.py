"""Episode quality at a glance: per-episode measurements, outlier flags and previews.

Before anyone trains, a lab wants to see its demonstrations. For every accepted
episode of a pairing manifest this module reads the ``<STEM>_vio.mcap`` once
(:func:`dpflow_core.recordings.read_streams`) and measures:

- duration (the overlap of camera, pose and gripper streams, which is what
  conversion keeps) and the full recorded span;
- the measured rate of each stream (1 / median capture interval, robust to drops);
- the VIO ``score`` distribution and the ``pose_valid == false`` gaps (VIO lost
  tracking), each gap measured from its first invalid pose to the next valid one;
- camera frames trimmed (outside the stream overlap), dropped (capture intervals
  longer than 1.5 median intervals) and undecodable (before the first IDR frame);
- the gripper width range;
- the plausibility findings of the pose and gripper streams (:mod:`dpflow_core.recordings.plausibility`:
  spikes, jumps, frozen VIO, a dead, stuck or out-of-range gripper), each of which flags the episode;
- the camera's and the IMU's offsets against the pose clock, measured from the recording
  (:mod:`dpflow_core.offsets`); an offset farther than
  :attr:`~dpflow_core.offsets.OffsetOptions.flag_threshold_s` from the task's median flags the episode;
- a preview PNG: a strip of decoded frames, the 3-D trajectory and the gripper
  width over time (matplotlib, Agg backend).

Outliers are flagged with a modified z-score against the task's median
(Iglewicz & Hoaglin, "How to Detect and Handle Outliers", ASQC 1993): an
episode is an outlier on a metric when ``|x - median| > 3.5 * scale`` where
``scale = 1.4826 * MAD``, floored by a per-metric minimum (:data:`OUTLIER_FLOORS`)
so that a task whose episodes agree exactly (MAD = 0) does not flag noise.

:func:`write_report` writes ``report.html`` (a table with the previews beside it
in ``previews/``) and ``quality.json``; :func:`markdown_table` gives the same
table as Markdown for a Dagster materialization.

This module is over 500 lines because the measurements, the outlier rule and the two renderings
(HTML, Markdown) share one row type, :class:`EpisodeQuality`, and are read together.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.conversion.align import DEFAULT_MAX_GAP_S
from dpflow_core.errors import DpflowError, InvalidNameError, PairingError, RecordingError
from dpflow_core.files import atomic_path, write_text_atomic
from dpflow_core.names import validate_name
from dpflow_core.offsets import DEFAULT_OPTIONS as OFFSET_OPTIONS, ImageMotion, measure_offsets, task_offsets
from dpflow_core.pairing.manifest import read_manifest_json
from dpflow_core.recordings import EpisodeStreams, read_streams
from dpflow_core.recordings.plausibility import check_gripper, check_pose, frame_motion
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap

#: ``|x - median| / scale`` above which an episode is flagged (Iglewicz & Hoaglin).
OUTLIER_Z = 3.5

#: Smallest scale (same unit as the metric) used for the outlier test, so that
#: identical episodes (MAD = 0) only flag differences that matter: duration in
#: seconds as a fraction of the median, score in score units, gaps in seconds.
OUTLIER_FLOORS: dict[str, float] = {"duration_s": 0.05, "score_median": 0.02, "pose_gap_total_s": 0.1}

#: Metric -> human name used in outlier reasons.
_METRIC_NAMES = {"duration_s": "duration", "score_median": "median VIO score", "pose_gap_total_s": "pose_valid gaps"}

#: Frames in the preview strip.
STRIP_FRAMES = 6


@dataclass(frozen=True)
class PoseGap:
    """A stretch where ``pose_valid`` is false (VIO lost tracking).

    Attributes:
        start_s: capture time of the first invalid pose, seconds from the episode start.
        end_s: capture time of the next valid pose (or the last invalid pose plus
            one median pose interval when the episode ends invalid), seconds.
        n_poses: invalid pose messages in the stretch.
    """

    start_s: float
    end_s: float
    n_poses: int

    @property
    def duration_s(self) -> float:
        """Length of the gap in seconds."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class EpisodeQuality:
    """Quality measurements of one accepted episode.

    Times are seconds from the episode start (the earliest capture time of the
    camera, pose and gripper streams); rates are Hz; widths are metres.

    Attributes:
        stem: the episode's file stem.
        vio_mcap: path of the ``<STEM>_vio.mcap`` read.
        sha256: its SHA-256 from the manifest (``None`` when the manifest has none).
        duration_s: length of the overlap of the three streams (kept by conversion).
        recorded_s: earliest to latest capture time over the three streams.
        camera_hz, pose_hz, gripper_hz: 1 / median capture interval of each stream.
        n_camera, n_pose, n_gripper: messages of each stream after de-duplication.
        score_min, score_p05, score_median, score_p95: VIO score distribution over
            all poses (float).
        valid_fraction: fraction of poses with ``pose_valid`` true, in [0, 1].
        pose_gaps: the ``pose_valid == false`` stretches, in time order.
        frames_trimmed: camera frames outside the stream overlap.
        frames_dropped: camera frames missing from the capture sequence (intervals
            longer than 1.5 median intervals, counted in median intervals).
        frames_undecodable: camera packets that decoded to no frame (e.g. before
            the first IDR frame); ``None`` when the codec is not decoded.
        gripper_min_m, gripper_max_m: gripper width range, metres.
        log_time_inversions: messages that arrived before one captured earlier.
        camera_gaps: holes in the camera stream longer than the report's ``max_gap_s``:
            ``{"at_s", "duration_s", "missing_frames"}`` (seconds from the episode start);
            conversion never bridges them (it splits or rejects the episode).
        findings: the plausibility findings of its pose and gripper streams
            (:class:`~dpflow_core.recordings.plausibility.Finding` as dicts: code, stream, time,
            figure, limit, and the action conversion's default policy takes); each also flags it.
        camera_offset, imu_offset: the offsets against the pose clock
            (:meth:`~dpflow_core.offsets.OffsetEstimate.to_dict`: status, ``offset_s``, confidence).
        outlier_reasons: why the episode is flagged (empty when it is not).
        robust_z: metric -> ``(x - task median) / scale`` (see module docstring).
        preview_png: path of the preview image, ``None`` when not drawn.
    """

    stem: str
    vio_mcap: str
    sha256: str | None
    duration_s: float
    recorded_s: float
    camera_hz: float
    pose_hz: float
    gripper_hz: float
    n_camera: int
    n_pose: int
    n_gripper: int
    score_min: float
    score_p05: float
    score_median: float
    score_p95: float
    valid_fraction: float
    pose_gaps: tuple[PoseGap, ...]
    frames_trimmed: int
    frames_dropped: int
    frames_undecodable: int | None
    gripper_min_m: float
    gripper_max_m: float
    log_time_inversions: int
    camera_gaps: tuple[dict, ...] = ()
    findings: tuple[dict, ...] = ()
    camera_offset: dict = field(default_factory=dict)
    imu_offset: dict = field(default_factory=dict)
    outlier_reasons: tuple[str, ...] = ()
    robust_z: dict[str, float] = field(default_factory=dict)
    preview_png: str | None = None

    @property
    def pose_gap_total_s(self) -> float:
        """Total length of the ``pose_valid == false`` gaps, seconds."""
        return float(sum(g.duration_s for g in self.pose_gaps))

    @property
    def pose_gap_longest_s(self) -> float:
        """Longest ``pose_valid == false`` gap, seconds (0 when none)."""
        return float(max((g.duration_s for g in self.pose_gaps), default=0.0))

    @property
    def is_outlier(self) -> bool:
        """True when any metric is far from the task's median."""
        return bool(self.outlier_reasons)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field plus the derived gap totals and ``is_outlier``."""
        d = asdict(self)
        d["pose_gaps"] = [dict(asdict(g), duration_s=g.duration_s) for g in self.pose_gaps]
        d["outlier_reasons"] = list(self.outlier_reasons)
        d["camera_gaps"] = [dict(g) for g in self.camera_gaps]
        d["findings"] = [dict(f) for f in self.findings]
        d.update(pose_gap_total_s=self.pose_gap_total_s, pose_gap_longest_s=self.pose_gap_longest_s, is_outlier=self.is_outlier)
        return d


@dataclass(frozen=True)
class ReportResult:
    """What :func:`write_report` wrote.

    Attributes:
        html_path: ``report.html``.
        json_path: ``quality.json`` (task, per-episode measurements, rejected entries).
        preview_dir: folder of the ``<stem>.png`` previews.
        episodes: the measurements, in manifest order.
        task: the manifest's task name.
        unreadable: accepted entries that could not be measured (file gone, unreadable,
            damaged since pairing, unsafe stem): ``{"stem", "path", "code", "reason",
            "stage": "report"}``; they are also listed as rejected in the report.
    """

    html_path: Path
    json_path: Path
    preview_dir: Path
    episodes: list[EpisodeQuality]
    task: str
    unreadable: list[dict] = field(default_factory=list)

    @property
    def outliers(self) -> list[str]:
        """Stems of the flagged episodes."""
        return [e.stem for e in self.episodes if e.is_outlier]


# ---------------------------------------------------------------- manifest

def _manifest_data(manifest: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], Path | None]:
    """A pairing manifest as a dict, with the folder it came from.

    The report reads only ``root``, ``task``, ``rejected`` and each accepted entry's stem and
    ``files.vio_mcap``, so a hand-made manifest with just those (relative paths allowed) is
    measured too; the file is read by pairing's one reader (:func:`dpflow_core.pairing.read_manifest_json`).

    Args:
        manifest: path of the manifest JSON, or the already-parsed dict.

    Returns:
        ``(manifest_dict, manifest_folder_or_None)``.

    Raises:
        PairingError: the file is missing, not a JSON object, or has no ``accepted`` list.
    """
    if isinstance(manifest, Mapping):
        data, folder = dict(manifest), None
    else:
        data, folder = read_manifest_json(manifest), Path(manifest).resolve().parent
    if not isinstance(data.get("accepted"), list):
        raise PairingError("manifest has no 'accepted' list", None if folder is None else manifest, code="bad_manifest")
    return data, folder


def _vio_path(entry: Mapping[str, Any], root: Path | None, where: str) -> tuple[Path, str | None]:
    try:
        info = entry["files"]["vio_mcap"]
        raw = info["path"] if isinstance(info, Mapping) else info
    except (KeyError, TypeError) as exc:
        raise PairingError(f"accepted entry {entry.get('stem')!r} has no files.vio_mcap.path", where, code="bad_manifest") from exc
    path = Path(raw)
    if not path.is_absolute() and root is not None:
        path = root / path
    sha = info.get("sha256") if isinstance(info, Mapping) else None
    return path, sha


# ---------------------------------------------------------------- measurements

def _median_hz(ts_ns: np.ndarray) -> float:
    if len(ts_ns) < 2:
        return 0.0
    dt = np.diff(ts_ns.astype(np.int64))
    med = float(np.median(dt))
    return 1e9 / med if med > 0 else 0.0


def _pose_gaps(ts_ns: np.ndarray, valid: np.ndarray, t0_ns: int) -> tuple[PoseGap, ...]:
    """Stretches of ``valid == False``; see :class:`PoseGap` for the end rule."""
    if len(valid) == 0 or valid.all():
        return ()
    period = float(np.median(np.diff(ts_ns))) if len(ts_ns) > 1 else 0.0
    invalid = (~valid).astype(np.int8)
    edges = np.diff(np.concatenate([[0], invalid, [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # ends: first valid index after
    gaps = []
    for a, b in zip(starts, ends):
        end_ns = ts_ns[b] if b < len(ts_ns) else ts_ns[b - 1] + period
        gaps.append(PoseGap(start_s=(ts_ns[a] - t0_ns) / 1e9, end_s=float(end_ns - t0_ns) / 1e9, n_poses=int(b - a)))
    return tuple(gaps)


def _decode_strip(streams: EpisodeStreams, n: int, image_motion: ImageMotion | None = None,
                  ) -> tuple[list[tuple[int, np.ndarray]], int | None, np.ndarray, np.ndarray]:
    """Decode every camera packet; keep about ``n`` evenly spaced RGB frames; feed each decoded frame's
    64x48 copy to ``image_motion`` (in the order of ``motion_ts_ns``).

    Returns ``([(capture_time_ns, (H, W, 3) uint8 RGB)], undecodable_packet_count, motion_ts_ns,
    motion)``; the count is ``None`` for a codec PyAV is not asked to decode; ``motion`` is each
    decoded frame's image change (:func:`~dpflow_core.recordings.plausibility.frame_motion` of a
    64x48 copy) at its capture time ``motion_ts_ns``.
    """
    import av

    codec = {"h264": "h264", "h265": "hevc", "hevc": "hevc"}.get(streams.camera_format.lower())
    packets = streams.camera_packets
    if codec is None or not packets:
        return [], None, np.zeros(0, dtype=np.int64), np.zeros(0)
    targets = sorted(set(np.linspace(0, len(packets) - 1, num=min(n, len(packets))).round().astype(int).tolist()))
    ctx = av.CodecContext.create(codec, "r")
    kept: list[tuple[int, np.ndarray]] = []
    decoded, k = 0, 0
    motion_ts: list[int] = []
    motion: list[float] = []
    thumb = None

    def take(frames):
        nonlocal decoded, k, thumb
        for frame in frames:
            decoded += 1
            idx = int(frame.pts) if frame.pts is not None else -1
            if 0 <= idx < len(packets):
                small = frame.reformat(width=64, height=48, format="rgb24").to_ndarray()
                change, thumb = frame_motion(small, thumb)
                if image_motion is not None:
                    image_motion.add(small)
                motion_ts.append(int(streams.camera_ts_ns[idx]))
                motion.append(change)
            if k < len(targets) and idx >= targets[k]:
                kept.append((int(streams.camera_ts_ns[idx]), frame.to_ndarray(format="rgb24")))
                while k < len(targets) and targets[k] <= idx:
                    k += 1

    for i, data in enumerate(packets):
        pkt = av.Packet(data)
        pkt.pts = i
        try:
            take(ctx.decode(pkt))
        except av.error.FFmpegError:
            continue  # no SPS/PPS yet (leading P-frames) or a damaged unit: counted below
    try:
        take(ctx.decode(None))
    except av.error.FFmpegError:
        pass
    return kept, len(packets) - decoded, np.asarray(motion_ts, dtype=np.int64), np.asarray(motion)


def _measure(stem: str, path: Path, sha256: str | None, streams: EpisodeStreams,
             max_gap_s: float = DEFAULT_MAX_GAP_S) -> tuple[EpisodeQuality, int]:
    # A repeated camera capture time is one frame (conversion keeps the first).
    cam, pose, grip = np.unique(streams.camera_ts_ns), streams.pose_ts_ns, streams.gripper_ts_ns
    present = [s for s in (cam, pose, grip) if len(s)]
    t0 = int(min(s[0] for s in present))
    t_end = int(max(s[-1] for s in present))
    lo, hi = int(max(s[0] for s in present)), int(min(s[-1] for s in present))
    cam_period = float(np.median(np.diff(cam))) if len(cam) > 1 else 0.0
    dropped = 0
    if cam_period > 0:
        dt = np.diff(cam)
        long = dt[dt > 1.5 * cam_period]
        dropped = int(np.sum(np.round(long / cam_period) - 1))
    holes = tuple(
        {"at_s": round((int(cam[i]) - t0) / 1e9, 4), "duration_s": round(float(cam[i + 1] - cam[i]) / 1e9, 4),
         "missing_frames": int(round((cam[i + 1] - cam[i]) / cam_period)) - 1}
        for i in np.flatnonzero(np.diff(cam) > max_gap_s * 1e9)
    ) if cam_period > 0 else ()
    score = streams.score.astype(np.float64)
    pct = np.percentile(score, [5, 50, 95]) if len(score) else np.zeros(3)
    q = EpisodeQuality(
        stem=stem,
        vio_mcap=str(path),
        sha256=sha256,
        duration_s=max(hi - lo, 0) / 1e9,
        recorded_s=(t_end - t0) / 1e9,
        camera_hz=_median_hz(cam),
        pose_hz=_median_hz(pose),
        gripper_hz=_median_hz(grip),
        n_camera=len(cam),
        n_pose=len(pose),
        n_gripper=len(grip),
        score_min=float(score.min()) if len(score) else 0.0,
        score_p05=float(pct[0]),
        score_median=float(pct[1]),
        score_p95=float(pct[2]),
        valid_fraction=float(np.mean(streams.pose_valid)) if len(streams.pose_valid) else 0.0,
        pose_gaps=_pose_gaps(pose, streams.pose_valid, t0),
        frames_trimmed=int(np.count_nonzero((cam < lo) | (cam > hi))),
        frames_dropped=dropped,
        frames_undecodable=None,
        gripper_min_m=float(streams.gripper_width_m.min()) if len(grip) else 0.0,
        gripper_max_m=float(streams.gripper_width_m.max()) if len(grip) else 0.0,
        log_time_inversions=int(sum(streams.log_time_inversions.values())),
        camera_gaps=holes,
    )
    return q, t0


def flag_outliers(episodes: Sequence[EpisodeQuality]) -> list[EpisodeQuality]:
    """Return copies of ``episodes`` with ``robust_z`` and ``outlier_reasons`` filled.

    For each metric in :data:`OUTLIER_FLOORS` (duration, median score, total
    ``pose_valid`` gap time): ``z = (x - median) / max(1.4826 * MAD, floor)``,
    flagged when ``|z| > OUTLIER_Z``. The duration floor is relative (a fraction
    of the median duration); the others are absolute. A measured camera or IMU offset farther
    than :attr:`~dpflow_core.offsets.OffsetOptions.flag_threshold_s` from the task's median
    flags the episode with both figures (:func:`~dpflow_core.offsets.task_offsets`).
    """
    if not episodes:
        return []
    values = {
        "duration_s": np.array([e.duration_s for e in episodes]),
        "score_median": np.array([e.score_median for e in episodes]),
        "pose_gap_total_s": np.array([e.pose_gap_total_s for e in episodes]),
    }
    stats = {}
    for name, x in values.items():
        med = float(np.median(x))
        floor = OUTLIER_FLOORS[name] * (abs(med) if name == "duration_s" else 1.0)
        stats[name] = (med, max(1.4826 * float(np.median(np.abs(x - med))), floor, 1e-12))
    offset_flags: dict[str, list[str]] = {}
    entries = [{"stem": e.stem, "camera_offset_s": e.camera_offset.get("offset_s"), "camera_offset": e.camera_offset,
                "imu_offset_s": e.imu_offset.get("offset_s"), "imu_offset": e.imu_offset} for e in episodes]
    for f in task_offsets(entries, OFFSET_OPTIONS.flag_threshold_s)["flagged"]:
        offset_flags.setdefault(f["stem"], []).append(f["reason"])
    out = []
    for i, e in enumerate(episodes):
        z, reasons = {}, []
        for name, x in values.items():
            med, scale = stats[name]
            z[name] = round(float((x[i] - med) / scale), 3)
            if abs(z[name]) > OUTLIER_Z:
                unit = "" if name == "score_median" else " s"
                reasons.append(f"{_METRIC_NAMES[name]} {x[i]:.3g}{unit} vs task median {med:.3g}{unit} (z={z[name]:+.1f})")
        reasons.extend(f"implausible {f['reason']}" for f in e.findings)
        reasons.extend(offset_flags.get(e.stem, []))
        for g in e.camera_gaps:
            reasons.append(f"camera hole {g['duration_s']:.2f} s after {g['at_s']:.2f} s "
                           f"({g['missing_frames']} frames missing; conversion splits or rejects, never bridges)")
        out.append(replace(e, robust_z=z, outlier_reasons=tuple(reasons)))
    return out


def episode_quality(
    manifest: str | Path | Mapping[str, Any],
    preview_dir: str | Path | None = None,
    topics: TopicMap = DAS_DEFAULT,
    strip_frames: int = STRIP_FRAMES,
    unreadable: list[dict] | None = None,
    max_gap_s: float = DEFAULT_MAX_GAP_S,
) -> list[EpisodeQuality]:
    """Measure every accepted episode of a pairing manifest and flag outliers.

    Args:
        manifest: the manifest JSON path or dict: ``{"task", "root", "accepted":
            [{"stem", "files": {"vio_mcap": {"path", "sha256", ...}, ...}, ...}],
            "rejected": [...]}``. Relative paths are taken from ``root`` (itself
            relative to the manifest's folder).
        preview_dir: when given, a ``<stem>.png`` preview per episode is written
            there (created if missing; existing previews are replaced, they are
            derived from the recording alone).
        topics: topic names of the recordings.
        strip_frames: frames in the preview strip.
        unreadable: when a list is given, an episode that cannot be measured (an OS
            error such as a missing or unreadable file: code ``unreadable``; a damaged
            recording: its :class:`RecordingError` code; a stem that is not a safe name:
            ``invalid_stem``) is appended to it as ``{"stem", "path", "code", "reason",
            "stage": "report"}`` and left out; when None such an episode raises.
        max_gap_s: camera holes longer than this (seconds) are listed (``camera_gaps``)
            and flagged.

    Returns:
        One :class:`EpisodeQuality` per measured episode, in manifest order.

    Raises:
        PairingError: the manifest is missing, not JSON or malformed.
        RecordingError: (``unreadable`` None) a recording is missing, truncated or not a
            Matrix Studio recording.
        InvalidNameError: (``unreadable`` None) a stem is not a safe file name.
        OSError: (``unreadable`` None) a recording cannot be read.
    """
    data, folder = _manifest_data(manifest)
    where = None if folder is None else str(manifest)
    root = Path(data["root"]) if data.get("root") else None
    if root is not None and not root.is_absolute() and folder is not None:
        root = folder / root
    if preview_dir is not None:
        preview_dir = Path(preview_dir)
        preview_dir.mkdir(parents=True, exist_ok=True)
    episodes, previews = [], []
    for entry in data["accepted"]:
        stem = str(entry.get("stem", ""))
        path, sha = _vio_path(entry, root, where)
        try:
            validate_name(stem, "stem")
            streams = read_streams(path, topics)
            if not len(streams.pose_ts_ns):
                raise RecordingError("no pose messages", path, code="empty_stream")
        except (DpflowError, OSError) as exc:
            if unreadable is None:
                raise
            if isinstance(exc, OSError):
                code, reason = "unreadable", f"cannot read {path.name}: {exc.strerror or exc} (errno {exc.errno})"
            else:
                code = "invalid_stem" if isinstance(exc, InvalidNameError) else exc.code
                reason = exc.reason
            unreadable.append({"stem": stem, "path": str(path), "code": code, "reason": reason, "stage": "report"})
            continue
        q, t0 = _measure(stem, path, sha, streams, max_gap_s)
        image_motion = ImageMotion(len(streams.camera_packets))
        frames, undecodable, motion_ts, motion = _decode_strip(streams, strip_frames if preview_dir is not None else 0,
                                                               image_motion)
        offsets = measure_offsets(image_motion, motion_ts, streams.pose_ts_ns, streams.quat_xyzw, streams.position_m,
                                  streams.pose_valid, streams.imu_ts_ns, streams.gyro_rps)
        findings = check_pose(streams.pose_ts_ns, streams.position_m, streams.quat_xyzw, t0,
                              motion_ts_ns=motion_ts, motion=motion).findings
        findings += check_gripper(streams.gripper_ts_ns, streams.gripper_width_m, streams.pose_ts_ns, streams.position_m, t0)
        episodes.append(replace(q, frames_undecodable=undecodable, findings=tuple(f.to_dict() for f in findings),
                                camera_offset=offsets["camera_offset"], imu_offset=offsets["imu_offset"]))
        if preview_dir is not None:
            previews.append(PreviewData(
                frames=frames,
                t0_ns=t0,
                position_m=streams.position_m,
                pose_valid=streams.pose_valid,
                gripper_ts_ns=streams.gripper_ts_ns,
                gripper_width_m=streams.gripper_width_m,
            ))
        del streams  # the camera packets are the bulk of an episode; keep only the preview data
    episodes = flag_outliers(episodes)
    if preview_dir is not None:
        for i, (q, data_i) in enumerate(zip(episodes, previews)):
            png = preview_dir / f"{q.stem or Path(q.vio_mcap).stem}.png"
            draw_preview(q, data_i, png)
            episodes[i] = replace(q, preview_png=str(png))
    return episodes


# ---------------------------------------------------------------- drawing

@dataclass(frozen=True)
class PreviewData:
    """What a preview is drawn from (the decoded strip and the low-rate streams).

    Attributes:
        frames: [(capture_time_ns, (H, W, 3) uint8 RGB)] evenly spaced decoded frames.
        t0_ns: capture time of the episode start (ns).
        position_m: (M, 3) float64 camera positions, metres.
        pose_valid: (M,) bool.
        gripper_ts_ns: (G,) int64; gripper_width_m: (G,) float64 metres.
    """

    frames: list[tuple[int, np.ndarray]]
    t0_ns: int
    position_m: np.ndarray
    pose_valid: np.ndarray
    gripper_ts_ns: np.ndarray
    gripper_width_m: np.ndarray


def draw_preview(quality: EpisodeQuality, data: PreviewData, out_png: str | Path) -> Path:
    """Draw an episode's preview PNG (900 x 400 px).

    Top: the decoded frames with their time (s). Bottom left: the 3-D camera
    trajectory in metres on equal axes, start in green, ``pose_valid == false``
    poses in red. Bottom right: gripper width (mm) over time (s), ``pose_valid``
    gaps shaded red. The title says when the episode is an outlier. Written to a
    temporary name in the same folder, then renamed.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out_png = Path(out_png)
    frames, t0_ns = data.frames, data.t0_ns
    cols = max(len(frames), 2)
    fig = Figure(figsize=(9.0, 4.0), dpi=100)
    fig.subplots_adjust(left=0.04, right=0.98, top=0.88, bottom=0.12, hspace=0.25, wspace=0.25)
    grid = fig.add_gridspec(2, 2 * cols, height_ratios=[1, 1.7])
    for i, (ts, img) in enumerate(frames):
        ax = fig.add_subplot(grid[0, 2 * i : 2 * i + 2])
        ax.imshow(img)
        ax.set_axis_off()
        ax.set_title(f"{(ts - t0_ns) / 1e9:.1f} s", fontsize=7, pad=2)
    ax3 = fig.add_subplot(grid[1, :cols], projection="3d")
    p, v = data.position_m, data.pose_valid
    ax3.plot(p[:, 0], p[:, 1], p[:, 2], lw=1.0, color="tab:blue")
    if (~v).any():
        ax3.scatter(p[~v, 0], p[~v, 1], p[~v, 2], s=4, color="tab:red", label="pose_valid=false")
        ax3.legend(fontsize=6, loc="upper left")
    ax3.scatter(*p[0], s=14, color="tab:green")
    centre = (p.max(axis=0) + p.min(axis=0)) / 2
    half = max(float(np.ptp(p, axis=0).max()) / 2, 1e-3)
    for setter, c in zip((ax3.set_xlim, ax3.set_ylim, ax3.set_zlim), centre):
        setter(c - half, c + half)
    for setter, name in zip((ax3.set_xlabel, ax3.set_ylabel, ax3.set_zlabel), "xyz"):
        setter(f"{name} (m)", fontsize=6, labelpad=-6)
    for axis in (ax3.xaxis, ax3.yaxis, ax3.zaxis):
        axis.set_major_locator(MaxNLocator(3))  # fewer ticks: a 3-D axis draws each one in Python
    ax3.tick_params(labelsize=5, pad=-2)
    axg = fig.add_subplot(grid[1, cols:])
    axg.plot((data.gripper_ts_ns - t0_ns) / 1e9, data.gripper_width_m * 1e3, lw=1.0, color="tab:purple")
    for g in quality.pose_gaps:
        axg.axvspan(g.start_s, g.end_s, color="tab:red", alpha=0.2, lw=0)
    axg.set_xlabel("time (s)", fontsize=7)
    axg.set_ylabel("gripper width (mm)", fontsize=7)
    axg.tick_params(labelsize=6)
    title = f"{quality.stem}: {quality.duration_s:.1f} s, score median {quality.score_median:.2f}"
    if quality.is_outlier:
        title += "  OUTLIER: " + "; ".join(quality.outlier_reasons)
    fig.suptitle(title, fontsize=8, color="tab:red" if quality.is_outlier else "black")
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return out_png


# ---------------------------------------------------------------- tables and report

_COLUMNS = (
    "episode", "duration s", "camera/pose/gripper Hz", "score p05 / median", "valid %",
    "pose gaps (n, longest s)", "frames trimmed/dropped/undecodable", "gripper mm", "camera / IMU offset ms",
    "outlier",
)


def _offset_cell(estimate: Mapping[str, Any]) -> str:
    """An offset in ms with its peak R^2, ``not measurable`` or ``-`` (no such stream / not measured)."""
    if estimate.get("status") == "measured":
        return f"{1e3 * estimate['offset_s']:+.1f} (R\u00b2 {estimate['r2']:.2f})"
    return "not measurable" if estimate.get("status") == "not_measurable" else "-"


def quality_figures(episodes: Sequence[EpisodeQuality]) -> dict[str, int | float]:
    """The task's headline figures: ``outliers`` (episodes flagged), ``total_duration_s`` (s, summed) and
    ``median_vio_score`` (the upper median of the episodes' median VIO scores; 0.0 without episodes)."""
    scores = sorted(e.score_median for e in episodes)
    return {
        "outliers": sum(e.is_outlier for e in episodes),
        "total_duration_s": float(sum(e.duration_s for e in episodes)),
        "median_vio_score": float(scores[len(scores) // 2]) if scores else 0.0,
    }


def report_dir_for(workdir: str | Path, manifest_path: str | Path) -> Path:
    """Where the quality report of a saved manifest goes: ``<workdir>/reports/<manifest file stem>``
    (named like the content-addressed manifest, ``<task>-<hash12>``)."""
    return Path(workdir) / "reports" / Path(manifest_path).stem


def _row(e: EpisodeQuality) -> list[str]:
    undec = "-" if e.frames_undecodable is None else str(e.frames_undecodable)
    return [
        e.stem,
        f"{e.duration_s:.2f}",
        f"{e.camera_hz:.1f} / {e.pose_hz:.1f} / {e.gripper_hz:.1f}",
        f"{e.score_p05:.2f} / {e.score_median:.2f}",
        f"{100 * e.valid_fraction:.1f}",
        f"{len(e.pose_gaps)}, {e.pose_gap_longest_s:.2f}",
        f"{e.frames_trimmed} / {e.frames_dropped} / {undec}",
        f"{1e3 * e.gripper_min_m:.1f}-{1e3 * e.gripper_max_m:.1f}",
        f"{_offset_cell(e.camera_offset)} / {_offset_cell(e.imu_offset)}",
        "; ".join(e.outlier_reasons) if e.outlier_reasons else "",
    ]


def markdown_table(episodes: Sequence[EpisodeQuality], image_links: Mapping[str, str] | None = None) -> str:
    """The per-episode table as GitHub-flavoured Markdown.

    Args:
        episodes: the measurements.
        image_links: stem -> URL or path of its preview; adds a ``preview``
            column with ``![stem](link)`` when given.
    """
    cols = list(_COLUMNS) + (["preview"] if image_links is not None else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for e in episodes:
        cells = [c.replace("|", "\\|") for c in _row(e)]
        if e.is_outlier:
            cells[-1] = f"**{cells[-1]}**"
        if image_links is not None:
            link = image_links.get(e.stem)
            cells.append(f"![{e.stem}]({link})" if link else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _html(task: str, manifest_label: str, episodes: Sequence[EpisodeQuality], rejected: Sequence[Any], out_dir: Path) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in (*_COLUMNS, "preview"))
    rows = []
    for e in episodes:
        cells = "".join(f"<td>{esc(c)}</td>" for c in _row(e))
        img = ""
        if e.preview_png:
            rel = os.path.relpath(e.preview_png, out_dir)
            img = f'<a href="{esc(rel)}"><img src="{esc(rel)}" alt="{esc(e.stem)}" width="450"></a>'
        cls = ' class="outlier"' if e.is_outlier else ""
        rows.append(f"<tr{cls}>{cells}<td>{img}</td></tr>")
    rej = []
    for r in rejected:
        if isinstance(r, Mapping):
            stem = r.get("stem") or r.get("path") or ""
            reason = r.get("reason") or r.get("reasons") or json.dumps(r, default=str)
        else:
            stem, reason = "", r
        rej.append(f"<tr><td>{esc(str(stem))}</td><td>{esc(str(reason))}</td></tr>")
    n_out = sum(e.is_outlier for e in episodes)
    total = sum(e.duration_s for e in episodes)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dpflow episode quality: {esc(task)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: middle; }}
tr.outlier td {{ background: #fde8e8; }}
</style></head><body>
<h1>Episode quality: {esc(task)}</h1>
<p>Manifest: <code>{esc(manifest_label)}</code><br>
{len(episodes)} accepted episodes, {total:.1f} s in all; {len(rejected)} rejected; {n_out} flagged as outliers
(|x &minus; median| &gt; {OUTLIER_Z} &times; max(1.4826 MAD, floor) on duration, median VIO score, pose_valid gaps;
camera or IMU offset more than {1e3 * OFFSET_OPTIONS.flag_threshold_s:g} ms from the task median).</p>
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Rejected</h2>
<table><thead><tr><th>stem</th><th>reason</th></tr></thead><tbody>
{chr(10).join(rej) if rej else '<tr><td colspan="2">none</td></tr>'}
</tbody></table>
</body></html>
"""


def write_report(
    manifest: str | Path | Mapping[str, Any],
    out_dir: str | Path,
    overwrite: bool = False,
    topics: TopicMap = DAS_DEFAULT,
) -> ReportResult:
    """Measure a manifest's accepted episodes and write an HTML quality report.

    Writes ``out_dir/report.html``, ``out_dir/quality.json`` and
    ``out_dir/previews/<stem>.png`` (each to a temporary name, then renamed).

    Args:
        manifest: manifest JSON path or dict (see :func:`episode_quality`).
        out_dir: the report folder (created if missing).
        overwrite: replace an existing report in ``out_dir``.
        topics: topic names of the recordings.

    Raises:
        DpflowError: (code ``output_exists``) ``out_dir`` already holds a report
            and ``overwrite`` is false.
        PairingError, RecordingError: as :func:`episode_quality`.
    """
    out_dir = Path(out_dir)
    html_path, json_path, preview_dir = out_dir / "report.html", out_dir / "quality.json", out_dir / "previews"
    if not overwrite and (html_path.exists() or json_path.exists()):
        raise DpflowError("a report already exists here; pass --overwrite (overwrite=True from Python) to replace it", out_dir, code="output_exists")
    data, _ = _manifest_data(manifest)
    out_dir.mkdir(parents=True, exist_ok=True)
    unreadable: list[dict] = []
    episodes = episode_quality(data if isinstance(manifest, Mapping) else manifest, preview_dir, topics, unreadable=unreadable)
    task = str(data.get("task", ""))
    rejected = list(data.get("rejected") or []) + unreadable
    label = "(in memory)" if isinstance(manifest, Mapping) else str(Path(manifest).resolve())
    summary = {
        "task": task,
        "manifest": label,
        "outlier_rule": {"z": OUTLIER_Z, "floors": OUTLIER_FLOORS},
        "episodes": [e.to_dict() for e in episodes],
        "rejected": rejected,
    }
    write_text_atomic(json_path, json.dumps(summary, indent=2, default=_json_default))
    write_text_atomic(html_path, _html(task, label, episodes, rejected, out_dir))
    return ReportResult(html_path=html_path, json_path=json_path, preview_dir=preview_dir, episodes=episodes, task=task,
                        unreadable=unreadable)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def thumbnail_data_uri(png: str | Path, width: int, *, quality: int = 80) -> str:
    """A ``data:image/jpeg;base64,...`` URI of ``png`` scaled to ``width`` pixels (aspect kept), JPEG ``quality``.

    For a table shown where local files cannot be read (a web UI). Returns ``""`` when the file
    cannot be read as an image or encoded (OpenCV ``imread``/``imencode``).
    """
    import cv2

    image = cv2.imread(str(png), cv2.IMREAD_COLOR)
    if image is None:
        return ""
    height = max(1, round(image.shape[0] * width / image.shape[1]))
    ok, data = cv2.imencode(".jpg", cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA),
                            [cv2.IMWRITE_JPEG_QUALITY, quality])
    return f"data:image/jpeg;base64,{base64.b64encode(data.tobytes()).decode('ascii')}" if ok else ""
