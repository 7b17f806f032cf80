"""Episode quality: each accepted episode of a pairing manifest measured from its ``<STEM>_vio.mcap``, and outliers flagged.

Takes a manifest (path or dict) and the recordings it names; gives :class:`EpisodeQuality` rows
(rates, VIO score, pose gaps, frames trimmed/dropped/undecodable, gripper range, camera holes,
plausibility findings, offsets, outlier reasons). The camera is decoded once, by conversion's own
decoder (:func:`decode_camera_strip`). The method of each figure: :mod:`dpflow_core.report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.conversion.settings import DEFAULT_MAX_GAP_S
from dpflow_core.conversion.decode import damage_findings
from dpflow_core.errors import DpflowError, InvalidNameError, PairingError, RecordingError
from dpflow_core.names import validate_name
from dpflow_core.offsets import DEFAULT_OPTIONS as OFFSET_OPTIONS, ImageMotion, check_clock_skew, measure_offsets, task_offsets
from dpflow_core.pairing.manifest import pairing_warnings, read_manifest_json
from dpflow_core.recordings import EpisodeStreams, read_streams
from dpflow_core.recordings.camera_pose import check_camera_pose
from dpflow_core.recordings.gripper_timing import check_gripper_offset, measure_gripper
from dpflow_core.recordings.orientation import check_orientation, check_translation
from dpflow_core.recordings.plausibility import PlausibilityOptions, check_gripper, check_imu, check_pose
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap
from dpflow_core.report.preview import PreviewData, draw_preview

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
#: Pairing warnings (``validation.warnings`` of the manifest) the report lists among an episode's findings: what
#: pairing tolerated but a person should see (a camera left out, an absurd calibration, a frozen optional clock,
#: a status file whose counts disagree).
PAIRING_FINDINGS = ("camera_not_converted", "camera_info_implausible", "clock_frozen", "status_count_mismatch")
#: Widest preview frame (pixels); a narrower camera keeps its size.
PREVIEW_WIDTH = 320


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
        findings: the plausibility findings of its pose and gripper streams, and the pairing warnings of
            :data:`PAIRING_FINDINGS` (``"stage": "pairing"``)
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


# ---------------------------------------------------------------- manifest

def manifest_data(manifest: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], Path | None]:
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


def invalid_findings(gaps: Sequence[PoseGap]) -> list[dict]:
    """Each ``pose_valid == false`` stretch as a finding of the report (``code`` ``pose_invalid``, ``stream``,
    ``at_s``, ``end_s``, ``value`` poses, ``reason``): what VIO holds there is no pose (often zeros), so the
    plausibility rules never judge it as a jump; conversion trims or rejects it (``invalid_pose_policy``)."""
    return [{"code": "pose_invalid", "stream": "pose", "at_s": round(g.start_s, 4), "end_s": round(g.end_s, 4),
             "value": g.n_poses, "unit": "poses", "action": "trimmed",
             "reason": (f"pose_invalid: pose from {g.start_s:.3f} to {g.end_s:.3f} s: {g.n_poses} poses with pose_valid "
                        "false (VIO lost tracking; their values are no pose); conversion keeps the longest valid "
                        "stretch (invalid_pose_policy trim) or rejects the episode")} for g in gaps]


def decode_camera_strip(streams: EpisodeStreams, path: Path, n: int, image_motion: ImageMotion | None = None,
                        damaged: list[dict] | None = None) -> tuple[list[tuple[int, np.ndarray]], int | None, np.ndarray, np.ndarray]:
    """Decode the camera as conversion does and keep about ``n`` evenly spaced RGB frames.

    One decode through :func:`~dpflow_core.conversion.decode.decode_camera` (each message split into
    its access units, B-frames decoded in decode order and placed by presentation time), at most
    :data:`PREVIEW_WIDTH` pixels wide, streamed to a scratch file that is removed on return. Each frame
    goes to ``image_motion`` in presentation order.

    Returns ``([(capture_time_ns, (H, W, 3) uint8 RGB)], undecodable_message_count, motion_ts_ns,
    motion)``; the count is ``None`` for a codec PyAV is not asked to decode; ``motion`` is each
    frame's image change (:func:`~dpflow_core.recordings.plausibility.frame_motion`) at its capture
    time ``motion_ts_ns``. A message counts as undecodable when it gave no frame and does not repeat
    an earlier message's capture time (whose frame conversion drops too). Frames decoded from a damaged
    reference are dropped as conversion drops them; ``damaged`` (a list) receives
    :func:`~dpflow_core.conversion.decode.decode_camera`'s entries for them.

    Raises:
        ConversionError: no frame decodes (``undecodable``), or the frames' order contradicts their
            capture times (``decode_error``).
    """
    import tempfile

    from dpflow_core.conversion.decode import decode_camera

    codec = {"h264": "h264", "h.264": "h264", "h265": "hevc", "hevc": "hevc"}.get(streams.camera_format.lower())
    packets = streams.camera_packets
    if codec is None or not len(packets):
        return [], None, np.zeros(0, dtype=np.int64), np.zeros(0)
    with tempfile.TemporaryDirectory(prefix="dpflow-report-") as scratch:
        frames, msg, _errors, _ranges, _crc, motion, times = decode_camera(
            packets, None, codec, Path(scratch) / "frames.npy", Path(path), streams.camera_ts_ns,
            image_motion.add if image_motion is not None else None, streams.camera_decode_order,
            max_width=PREVIEW_WIDTH, damaged=damaged)
        rows = sorted(set(np.linspace(0, len(times) - 1, num=min(n, len(times))).round().astype(int).tolist())) if n else []
        kept = [(int(times[r]), np.array(frames[r])) for r in rows]
        del frames
    undecodable = len(np.unique(streams.camera_ts_ns)) - len(np.unique(np.asarray(streams.camera_ts_ns)[msg]))
    return kept, int(undecodable), times, motion.astype(np.float64)


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
    flags the episode with both figures (:func:`~dpflow_core.offsets.task_offsets`), and so does an offset
    at the search limit (not measurable: the true offset may lie beyond).
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
    summary = task_offsets(entries, OFFSET_OPTIONS.flag_threshold_s)
    for f in summary["flagged"] + summary["at_search_limit"]:
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
        reasons.extend(f"{'' if f['code'] == 'pose_invalid' else 'implausible '}{f['reason']}" for f in e.findings)
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
    data, folder = manifest_data(manifest)
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
            q, t0 = _measure(stem, path, sha, streams, max_gap_s)
            image_motion = ImageMotion(len(streams.camera_packets))
            damaged: list[dict] = []
            frames, undecodable, motion_ts, motion = decode_camera_strip(
                streams, path, strip_frames if preview_dir is not None else 0, image_motion, damaged)
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
        offsets = measure_offsets(image_motion, motion_ts, streams.pose_ts_ns, streams.quat_xyzw, streams.position_m,
                                  streams.pose_valid, streams.imu_ts_ns, streams.gyro_rps)
        findings = check_pose(streams.pose_ts_ns, streams.position_m, streams.quat_xyzw, t0,
                              motion_ts_ns=motion_ts, motion=motion, valid=streams.pose_valid).findings
        findings += check_gripper(streams.gripper_ts_ns, streams.gripper_width_m, streams.pose_ts_ns, streams.position_m, t0)
        findings += check_orientation(streams.pose_ts_ns, streams.quat_xyzw, streams.imu_ts_ns, streams.gyro_rps,
                                      streams.accel_mps2, t0, PlausibilityOptions().validate())
        findings += check_imu(streams.imu_ts_ns, streams.gyro_rps, streams.accel_mps2, streams.pose_ts_ns,
                              streams.position_m, streams.quat_xyzw, t0)
        findings += check_translation(streams.pose_ts_ns, streams.position_m, streams.quat_xyzw, streams.imu_ts_ns,
                                      streams.accel_mps2, t0, PlausibilityOptions().validate())
        pose_t0 = int(streams.pose_ts_ns[0]) if len(streams.pose_ts_ns) else t0
        findings += check_clock_skew([offsets["camera_clock_skew"], offsets["imu_clock_skew"]], t0, pose_t0)
        findings += check_camera_pose(offsets, t0, streams.pose_ts_ns)
        offsets.update(measure_gripper(image_motion, motion_ts, streams.gripper_ts_ns, streams.gripper_width_m))
        findings += check_gripper_offset(offsets, t0, streams.gripper_ts_ns)
        found = invalid_findings(q.pose_gaps) + [f.to_dict() for f in findings] + damage_findings(damaged, t0) + [
            {**w, "action": "warned"} for w in pairing_warnings(entry) if w["code"] in PAIRING_FINDINGS]
        episodes.append(replace(q, frames_undecodable=undecodable, findings=tuple(found),
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
