"""Alignment of one episode: a ``<STEM>_vio.mcap`` camera stream in, frames and aligned low-dim arrays out.

Takes the recording's streams (camera packets, pose, gripper width) and the image size (W, H pixels);
gives an :class:`AlignedEpisode`: RGB frames (uint8 ``(T, H, W, 3)``, area-averaged), camera
timestamps (s), position (m) interpolated linearly, orientation by scipy ``Slerp`` (rotation vector,
rad), gripper width (m) linearly, trimmed to the streams' overlap, with a report of gaps and trimming.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.conversion.decode import SWS_FLAGS, damage_findings, decode_camera
from dpflow_core.conversion.gaps import find_gaps, cut_implausible, plan_segments
from dpflow_core.conversion.settings import ConversionSettings
from dpflow_core.conversion.trim import Timeline, keep_valid_poses
from dpflow_core.errors import ConversionError
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap

#: What aligning an episode imports beyond this module (SciPy's rotations, the MCAP reader and
#: protobuf): loaded on first use, so a process that only writes the dataset (the converting
#: parent of ``-j N`` workers) never pays for them; the worker pool preloads them once.
ALIGN_IMPORTS = ("scipy.spatial.transform", "dpflow_core.recordings.reader", "dpflow_core.recordings.inspection")


#: Version of the conversion procedure; part of every dataset's metadata and of
#: the content-addressed output folder, so a change of method never reuses an old dataset.
#: 2: every camera packet decoded (duplicate frames dropped after decoding), camera holes
#: longer than ``max_gap_s`` split or rejected instead of bridged.
#: 3: ``data__camera0_rgb`` is the first member of ``dataset.npz`` (its frames are appended while
#: later episodes are aligned), and each cached episode records its frames' CRC-32: same arrays,
#: other bytes, so dataset keys and cache entries of version 2 are not reused.
#: 4: the plausibility rules (:mod:`dpflow_core.recordings.plausibility`): pose spikes repaired,
#: jumps and frozen VIO cut out, implausible grippers rejected; one minimum episode length.
#: 5: each episode's camera-to-VIO and IMU-to-VIO offsets measured (:mod:`dpflow_core.offsets`).
#: 6: camera messages split into their access units (several per message each give a frame) and
#: B-frames decoded in decode order, placed by presentation time: version 5 gave a message with two
#: units one frame and shifted every later frame, so its cache entries are not reused; and the
#: pose's quaternion convention checked against the IMU (``quaternion_convention``).
#: 7: frames decoded from a damaged reference dropped (``damaged_frames``); a clock that went back in
#: file order and NaN/inf samples rejected by the reader.
#: 8: a camera message repeating the one before byte for byte is not decoded twice (``duplicate_payload``);
#: a clock step refused by the reader too; the IMU's plausibility classes.
#: 9: an offset at (or within one sample of) the search limit, or beaten beyond it, standing 0.15 R^2 above the
#: scan's median, is not measured (``at_search_limit``, warning ``offset_at_search_limit``); a still camera's moving pose (``vio_drift``) and an
#: entirely still episode (``episode_still``) found; positions in other units one finding (``pose_units``).
#: 10: the pose rules judge the valid poses only: a ``pose_valid == false`` stretch (VIO writes zeros there) is
#: trimmed as ``pose_invalid``, no longer also split as a ``pose_jump`` to and from the garbage; a track so far from the
#: origin that the dataset's float32 resolves it coarser than 0.1 mm is refused (``pose_far_origin``); a frozen VIO
#: is found where the camera changes 0.15 grey levels a frame (``frozen_motion``, was 1.0: above the world camera's).
#: 11: two or more consecutive pose spikes are one ``pose_glitch``, their span dropped: version 10 repaired each
#: against neighbours that were glitched too, moving the good samples of an alternating glitch onto it; a pose
#: track sampled under half as often as the camera is refused (``pose_rate_low``), and a camera or IMU clock that
#: runs fast or slow against the pose clock (``clock_skew``, each episode's drift in ``camera_clock_skew``), and
#: positions mirrored in one world axis against the accelerometer (``pose_mirrored``).
#: 12: a gyro that fits the pose track only negated (a time-reversed episode, a flipped gyro sign) is refused
#: (``imu_reversed``), and so is a camera whose fast image motion the pose explains at no offset (another recording's
#: camera: ``camera_pose_mismatch``; ``camera_offset`` gains its ``fast_r2``, ``fast_ceiling`` and
#: ``fast_rotation_rps``).
#: 13: the gripper-width stream's offset against the camera measured from the fingers' image change
#: (``gripper_offset_s`` and ``gripper_offset``, :mod:`dpflow_core.recordings.gripper_timing`): beyond 0.1 s warned,
#: beyond 0.25 s refused (``gripper_offset``).
#: 14: a clock's drift (``clock_skew``) is the Theil-Sen slope of its window offsets, not least squares: one
#: mis-measured window refused an honest world episode (1 of 480).
CONVERTER_VERSION = "14"
#: Member names and per-step shapes/dtypes (formats.md section 2), in the order written.
LOWDIM_KEYS = (
    "robot0_eef_pos",
    "robot0_eef_rot_axis_angle",
    "robot0_gripper_width",
    "robot0_demo_start_pose",
    "robot0_demo_end_pose",
)
LOWDIM_WIDTH = {
    "robot0_eef_pos": 3,
    "robot0_eef_rot_axis_angle": 3,
    "robot0_gripper_width": 1,
    "robot0_demo_start_pose": 6,
    "robot0_demo_end_pose": 6,
}


# --------------------------------------------------------------------------- alignment


@dataclass
class AlignedEpisode:
    """One episode decoded and aligned on its camera frames.

    Attributes:
        stem: the episode's stem.
        timestamps_s: (N,) float64 seconds from the first kept frame.
        start_ts_ns: capture time (``header.timestamp``, ns) of the first kept frame.
        camera_ts_ns: (N,) int64 capture times of the kept frames, ns.
        rgb: (N, H, W, 3) uint8 RGB frames; a read-only memory map when
            ``rgb_dir`` was given to :func:`align_episode` (the frames were streamed to that file).
        eef_pos: (N, 3) float32 camera0 optical-centre position, metres.
        eef_rot_axis_angle: (N, 3) float32 rotation vector, radians, norm <= pi.
        gripper_width: (N, 1) float32 metres.
        report: what was trimmed, dropped and measured (see :func:`align_episode`).
        rgb_path: the ``.npy`` file holding the decoded frames when ``rgb_dir``
            was given (rows ``rgb_rows[0]:rgb_rows[1]`` are ``rgb``), else None.
        rgb_rows: (start, stop) rows of ``rgb_path`` kept.
        segments: (start, stop) rows of the pieces to keep when the episode was split at
            camera gaps (``gap_policy="split"``), else None (keep it whole). See
            :func:`split_segments`.
        input_sha256: SHA-256 (hex) of the ``_vio.mcap``, hashed while it was parsed.
        rgb_range: (N, 2) uint8 per-frame (min, max) pixel value, measured while decoding
            (so the frames need not be read back for the value ranges); None when unknown.
        rgb_prefix_crc32: (K + 1,) int64, the zip CRC-32 of the first k rows of ``rgb_path``
            (all K decoded rows, not only ``rgb_rows``), kept while decoding; None without ``rgb_path``.
            :meth:`rgb_crc32` gives the CRC of the kept rows from it.
    """

    stem: str
    timestamps_s: np.ndarray
    start_ts_ns: int
    camera_ts_ns: np.ndarray
    rgb: np.ndarray
    eef_pos: np.ndarray
    eef_rot_axis_angle: np.ndarray
    gripper_width: np.ndarray
    report: dict
    rgb_path: Path | None = None
    rgb_rows: tuple[int, int] | None = None
    segments: list[tuple[int, int]] | None = None
    input_sha256: str | None = None
    rgb_range: np.ndarray | None = None
    rgb_prefix_crc32: np.ndarray | None = None

    def rgb_crc32(self) -> int | None:
        """CRC-32 (:func:`zlib.crc32`) of the bytes of rows ``rgb_rows`` of ``rgb_path``, from the prefix
        CRCs (:func:`~dpflow_core.files.crc32_combine`), without reading the frames; None when unknown."""
        if self.rgb_prefix_crc32 is None or self.rgb_rows is None:
            return None
        from dpflow_core.files import crc32_combine

        a, b = self.rgb_rows
        row = int(np.prod(self.rgb.shape[1:], dtype=np.int64))
        return crc32_combine(int(self.rgb_prefix_crc32[a]), int(self.rgb_prefix_crc32[b]), (b - a) * row)

    def __len__(self) -> int:
        return len(self.timestamps_s)

    @property
    def start_pose(self) -> np.ndarray:
        """(6,) float32 first pose: position (m) then rotation vector (rad)."""
        return np.concatenate([self.eef_pos[0], self.eef_rot_axis_angle[0]]).astype(np.float32)

    @property
    def end_pose(self) -> np.ndarray:
        """(6,) float32 last pose: position (m) then rotation vector (rad)."""
        return np.concatenate([self.eef_pos[-1], self.eef_rot_axis_angle[-1]]).astype(np.float32)


def split_segments(ep: AlignedEpisode) -> list[AlignedEpisode]:
    """The pieces of an episode split at its long camera gaps (``ep.segments``), each as its
    own :class:`AlignedEpisode` with timestamps from its own first frame; ``[ep]`` when the
    episode was not split. Arrays are views of ``ep``'s; ``report["segment"]`` says which
    piece it is ({index, of, rows, start_s, end_s}) and ``frames``/``duration_s`` are the piece's.
    """
    if not ep.segments:
        return [ep]
    out = []
    for k, (a, b) in enumerate(ep.segments):
        t0 = int(ep.camera_ts_ns[a])
        report = dict(ep.report)
        report["segment"] = {"index": k, "of": len(ep.segments), "rows": [a, b],
                             "start_s": round(float(ep.timestamps_s[a]), 4), "end_s": round(float(ep.timestamps_s[b - 1]), 4)}
        report["frames"] = b - a
        report["duration_s"] = round((int(ep.camera_ts_ns[b - 1]) - t0) / 1e9, 4)
        rows = None if ep.rgb_rows is None else (ep.rgb_rows[0] + a, ep.rgb_rows[0] + b)
        out.append(AlignedEpisode(
            stem=ep.stem, timestamps_s=(ep.camera_ts_ns[a:b] - t0) / 1e9, start_ts_ns=t0,
            camera_ts_ns=ep.camera_ts_ns[a:b], rgb=ep.rgb[a:b], eef_pos=ep.eef_pos[a:b],
            eef_rot_axis_angle=ep.eef_rot_axis_angle[a:b], gripper_width=ep.gripper_width[a:b],
            report=report, rgb_path=ep.rgb_path, rgb_rows=rows, input_sha256=ep.input_sha256,
            rgb_range=None if ep.rgb_range is None else ep.rgb_range[a:b], rgb_prefix_crc32=ep.rgb_prefix_crc32,
        ))
    return out


def align_episode(
    vio_mcap_path: str | Path,
    settings: ConversionSettings | None = None,
    *,
    topics: TopicMap = DAS_DEFAULT,
    min_frames: int = 2,
    stem: str | None = None,
    rgb_dir: str | Path | None = None,
) -> AlignedEpisode:
    """Decode and align one episode on its camera frames.

    Method: the camera stream (H.264 Annex-B, any number of access units per message,
    B-frames allowed) is decoded with PyAV in decode order (:func:`~dpflow_core.conversion.decode.decode_camera`);
    each frame is paired with the capture time of the message that produced it and placed by
    presentation time (never by index: frames before the first IDR are lost).
    Frames are converted to RGB and resized with area averaging in one swscale
    pass (``SWS_AREA`` with full-resolution chroma, as accurate as and faster
    than decode-to-BGR + OpenCV ``INTER_AREA``). All streams are cut to the interval
    where camera, pose and gripper overlap. At each frame time the position and
    gripper width are interpolated linearly and the orientation by slerp
    (``scipy.spatial.transform.Slerp``); a frame counts as pose-invalid when
    either bracketing pose has ``pose_valid == false`` (or a ``score`` below ``min_pose_score``).

    Args:
        vio_mcap_path: the ``<STEM>_vio.mcap`` file.
        settings: the conversion settings (default: :class:`ConversionSettings`'s defaults); this function
            uses ``image_size`` ((W, H) pixels of the output frames; None keeps the camera's native
            resolution), ``invalid_pose_policy`` (``"trim"`` keeps the longest stretch of valid poses,
            reported; ``"reject"`` rejects the episode for any invalid pose in the overlap),
            ``min_overlap_fraction`` (the kept frames must span this fraction of the recording, the union
            of all streams), ``max_gap_s`` and ``gap_policy`` (camera holes longer than ``max_gap_s``
            seconds are never bridged: ``"split"`` cuts the episode there into ``segments``, given by
            :func:`split_segments`, dropping pieces under ``min_segment_frames`` frames unless
            ``short_episode_policy`` is ``"warn"``; ``"reject"`` rejects it, ``camera_gap``),
            ``min_pose_score`` and ``plausibility`` (the pose, gripper and IMU rules run on the
            capture-ordered samples before interpolation: a spike is repaired, its original value
            recorded; a jump or a frozen VIO's span is dropped and the episode cut there, short pieces
            dropped as at a gap; a rejecting finding raises with its class as the code;
            ``report["plausibility"]`` lists every finding with stream, time, figure and action).
        topics: topic names of the recording.
        min_frames: reject the episode when fewer frames remain.
        stem: the episode's stem (default: file name without ``_vio.mcap``).
        rgb_dir: when given, frames are decoded into ``<rgb_dir>/<stem>.rgb.npy``
            (a memory map) instead of RAM, bounding memory for long episodes.

    Returns:
        The aligned episode. ``report`` holds: ``camera_messages``,
        ``decoded_frames``, ``leading_undecodable_packets`` (before the first
        decodable frame), ``undecodable_packets`` (after it), ``streams`` (start/end
        seconds and counts per stream, relative to the earliest stream start),
        ``overlap_s``, ``trimmed_s`` ({start, end, total}: recording time outside
        the kept frames), ``pose_invalid`` (policy, stretches, frames and seconds
        dropped), ``gaps`` (camera intervals longer than 1.5 frame periods),
        ``pose_gaps``, ``frames``, ``duration_s``, ``frequency_hz`` (1 / median
        frame interval), ``coverage``, the reader's ordering counts, and ``long_gaps``
        ({max_gap_s, policy, gaps: [{at_s, duration_s, missing_frames, row, action}],
        segments: [{rows, frames, start_s, end_s, kept}]}: every camera gap longer than
        ``max_gap_s`` and what was done with it), and ``offsets``: the camera's and the IMU's
        offsets against the pose clock (:func:`dpflow_core.offsets.measure_offsets`) and the gripper's against the
        camera's (:func:`dpflow_core.recordings.gripper_timing.measure_gripper`).

    Raises:
        RecordingError: the file cannot be read (see :func:`read_streams`).
        ConversionError: the camera is not H.264 (``not_h264``), nothing decodes
            (``undecodable``), the streams do not overlap (``no_overlap``), the
            kept frames cover too little of the recording (``low_coverage``), a
            pose is invalid under the ``reject`` policy (``pose_invalid``), too
            few frames remain (``too_short``), a camera gap is longer than ``max_gap_s``
            under ``gap_policy="reject"`` (``camera_gap``) or no segment is long enough
            under ``"split"`` (``too_short``), a position or gripper width is
            NaN/inf (``not_finite``), or a plausibility finding whose policy rejects (its class,
            e.g. ``gripper_dead``). An invalid setting is refused when the settings are built.
    """
    settings = settings or ConversionSettings()
    path = Path(vio_mcap_path)
    if stem is None:
        stem = path.name.removesuffix(".mcap").removesuffix("_vio")
    # With a scratch folder the access units wait in a spool file and the frames stream to a
    # file: memory does not grow with the episode's length.
    rgb_path = Path(rgb_dir) / f"{stem}.rgb.npy" if rgb_dir is not None else None
    cam = _decode_camera_stream(path, settings.image_size, topics, rgb_path,
                                Path(rgb_dir) / f"{stem}.h264" if rgb_dir is not None else None)
    streams, cam_ns = cam.streams, cam.cam_ns
    first_decoded = int(cam.pkt_idx.min())
    clock = Timeline(path, streams, cam_ns)
    in_overlap = (cam_ns >= clock.overlap[0]) & (cam_ns <= clock.overlap[1])
    pose_ok = streams.pose_valid & (streams.score >= settings.min_pose_score)
    verdict, findings = _check_plausibility(path, streams, clock.origin, settings.plausibility, cam_ns, cam.motion,
                                            pose_ok)
    lo, hi, invalid_info, coverage = keep_valid_poses(clock, in_overlap, pose_ok, settings, min_frames)

    kept_ns = cam_ns[lo:hi]
    t0 = int(kept_ns[0])
    t_s = (kept_ns - t0) / 1e9
    pose_t = streams.pose_ts_ns
    pose_s = (pose_t - t0) / 1e9
    pos, rot, grip = _interpolate(path, t_s, pose_s, verdict, (streams.gripper_ts_ns - t0) / 1e9, streams.gripper_width_m)

    period = float(np.median(np.diff(t_s)))
    used_pose = (pose_t >= kept_ns[0]) & (pose_t <= kept_ns[-1])
    pose_used_s = pose_s[used_pose]
    pose_period = float(np.median(np.diff(pose_used_s))) if len(pose_used_s) > 2 else period
    # Under short_episode_policy "warn" a short piece is kept (the caller warns about it).
    min_piece = 1 if settings.short_episode_policy == "warn" else settings.min_segment_frames
    gaps, segments, long_info = plan_segments(t_s, period, settings.max_gap_s, settings.gap_policy, min_piece, path)
    segments, plaus_info = cut_implausible(kept_ns, segments, verdict.drop_ns, min_piece, path, findings)
    plaus_info["options"] = settings.plausibility.to_dict()
    usable = pose_ok.copy()
    for a, b in verdict.drop_ns:
        usable &= (pose_t <= a) | (pose_t >= b)
    offsets, late = _offsets(path, cam, verdict, usable, clock.origin, settings.plausibility, findings)
    plaus_info["findings"] = plaus_info.get("findings", []) + [f.to_dict() for f in late]
    report = {
        "stem": stem,
        "path": str(path),
        "camera_messages": int(cam.n_packets),
        "decoded_frames": int(len(cam.pkt_idx)),
        "leading_undecodable_packets": first_decoded,
        "undecodable_packets": int(sum(1 for e in cam.errors if e > first_decoded)),
        "damaged_frames": damage_findings(cam.damaged, clock.origin),
        "streams": clock.stream_info,
        "overlap_s": [round(float(clock.rel(clock.overlap[0])), 4), round(float(clock.rel(clock.overlap[1])), 4)],
        "trimmed_s": {
            "start": round(float(clock.rel(kept_ns[0])), 4),
            "end": round(float((clock.end - int(kept_ns[-1])) / 1e9), 4),
            "total": round(float(clock.span_s - (int(kept_ns[-1]) - int(kept_ns[0])) / 1e9), 4),
        },
        "pose_invalid": invalid_info,
        "gaps": gaps,
        "long_gaps": long_info,
        "pose_gaps": find_gaps(pose_used_s, pose_period),
        "frames": int(hi - lo),
        "duration_s": round(float(t_s[-1]), 4),
        "frequency_hz": 1.0 / period,
        "coverage": round(float(coverage), 4),
        "plausibility": plaus_info,
        "log_time_inversions": dict(streams.log_time_inversions),
        "duplicate_timestamps": dict(streams.duplicate_timestamps),
        "offsets": offsets,
    }
    return AlignedEpisode(
        stem=stem, timestamps_s=t_s, start_ts_ns=t0, camera_ts_ns=kept_ns.astype(np.int64), rgb=cam.frames[lo:hi],
        eef_pos=pos.astype(np.float32), eef_rot_axis_angle=rot.as_rotvec().astype(np.float32),
        gripper_width=grip.astype(np.float32)[:, None], report=report, rgb_path=rgb_path,
        rgb_rows=(lo, hi) if rgb_path is not None else None, segments=segments, input_sha256=streams.sha256,
        rgb_range=cam.frame_range[lo:hi], rgb_prefix_crc32=cam.prefix_crc32,
    )


@dataclass
class _Camera:
    """The recording's streams (camera packets closed) and the camera's frames as
    :func:`~dpflow_core.conversion.decode.decode_camera` gave them: ``frames`` (N, H, W, 3) uint8,
    ``pkt_idx`` (N,) packet of each frame, ``errors`` (undecodable packet indices), ``frame_range`` (N, 2)
    uint8, ``prefix_crc32``, ``motion`` (per-frame image motion), ``cam_ns`` (N,) int64 capture times,
    ``damaged`` (frames decoded from a damaged reference), ``n_packets`` and the ``image_motion`` tracker."""

    streams: Any
    frames: np.ndarray
    pkt_idx: np.ndarray
    errors: Any
    frame_range: np.ndarray
    prefix_crc32: np.ndarray | None
    motion: Any
    cam_ns: np.ndarray
    damaged: list[dict]
    n_packets: int
    image_motion: Any


def _decode_camera_stream(path: Path, image_size: tuple[int, int] | None, topics: TopicMap, rgb_path: Path | None,
                          spool_path: Path | None) -> _Camera:
    """Read the recording's streams and decode its camera (:class:`_Camera`); ``not_h264`` unless H.264."""
    from dpflow_core.offsets import ImageMotion
    from dpflow_core.recordings.reader import read_streams

    streams = read_streams(path, topics, spool_path=spool_path)
    try:
        fmt = (streams.camera_format or "").lower()
        if fmt not in ("h264", "h.264"):
            raise ConversionError(f"camera format {streams.camera_format!r} is not H.264", path, code="not_h264")
        image_motion = ImageMotion(len(streams.camera_packets))
        damaged: list[dict] = []
        frames, pkt_idx, errors, frame_range, prefix_crc32, motion, cam_ns = decode_camera(
            streams.camera_packets, image_size, "h264", rgb_path, path, streams.camera_ts_ns, image_motion.add,
            streams.camera_decode_order, damaged=damaged)
        n_packets = len(streams.camera_packets)
    finally:
        if hasattr(streams.camera_packets, "close"):
            streams.camera_packets.close()
    return _Camera(streams, frames, pkt_idx, errors, frame_range, prefix_crc32, motion, cam_ns, damaged, n_packets,
                   image_motion)


def _offsets(path: Path, cam: _Camera, verdict: Any, usable: np.ndarray, origin: int, checks: Any,
             findings: list) -> tuple[dict, list]:
    """The measured offsets (the camera's and the IMU's against the pose clock on the ``usable`` poses of the
    repaired track ``verdict``, the gripper's against the camera's) and their findings, ``clock_skew`` (their drift),
    ``camera_pose_mismatch`` (a camera the pose explains at no offset) then ``gripper_offset`` (a gripper stream off
    the camera's clock); :class:`ConversionError` when one's policy rejects."""
    from dpflow_core.offsets import check_clock_skew, measure_offsets
    from dpflow_core.recordings.camera_pose import check_camera_pose
    from dpflow_core.recordings.gripper_timing import check_gripper_offset, measure_gripper
    from dpflow_core.recordings.plausibility import decide

    streams, pose_ts_ns = cam.streams, cam.streams.pose_ts_ns
    offsets = measure_offsets(cam.image_motion, cam.cam_ns, pose_ts_ns, verdict.quat_xyzw, verdict.position_m, usable,
                              streams.imu_ts_ns, streams.gyro_rps)
    offsets.update(measure_gripper(cam.image_motion, cam.cam_ns, streams.gripper_ts_ns, streams.gripper_width_m))
    late = check_clock_skew([offsets["camera_clock_skew"], offsets["imu_clock_skew"]], origin, int(pose_ts_ns[0]), checks)
    late += check_camera_pose(offsets, origin, pose_ts_ns, checks)
    late += check_gripper_offset(offsets, origin, streams.gripper_ts_ns, checks)
    _refuse_rejected(path, decide(late), findings + late)
    return offsets, late


def _refuse_rejected(path: Path, rejected: Any, findings: list) -> None:
    """:class:`ConversionError` with the class as code when a finding's policy rejects (``rejected``, from
    ``plausibility.decide``), naming up to five of the other ``findings``; nothing when ``rejected`` is None."""
    if rejected is not None:
        others = [f.describe() for f in findings if f is not rejected]
        raise ConversionError(f"{rejected.describe()} (policy {rejected.code}={rejected.policy})"
                              + (f"; also: {'; '.join(others[:5])}" if others else ""), path, code=rejected.code)


def _check_plausibility(path: Path, streams: Any, origin: int, checks: Any, cam_ns: np.ndarray, motion: Any,
                        pose_ok: np.ndarray):
    """The pose verdict (repaired track, spans to drop; the pose rules judge the ``pose_ok`` samples only: an
    invalid stretch is trimmed as ``pose_invalid``) and every plausibility finding of the pose, gripper,
    orientation and IMU rules; :class:`ConversionError` with the class as code when one's policy rejects."""
    from dpflow_core.recordings.orientation import check_orientation, check_translation
    from dpflow_core.recordings.plausibility import check_gripper, check_imu, check_pose, decide

    verdict = check_pose(streams.pose_ts_ns, streams.position_m, streams.quat_xyzw, origin, checks, cam_ns, motion,
                         pose_ok)
    pose = (streams.pose_ts_ns, streams.position_m, streams.quat_xyzw)
    imu = (streams.imu_ts_ns, streams.gyro_rps, streams.accel_mps2)
    findings = verdict.findings + check_gripper(streams.gripper_ts_ns, streams.gripper_width_m, *pose[:2], origin, checks)
    findings += check_orientation(pose[0], pose[2], *imu, origin, checks) + check_imu(*imu, *pose, origin, checks)
    findings += check_translation(pose[0], pose[1], pose[2], imu[0], imu[2], origin, checks)
    _refuse_rejected(path, decide(findings), findings)
    return verdict, findings


def _interpolate(path: Path, t_s: np.ndarray, pose_s: np.ndarray, verdict: Any, gripper_s: np.ndarray,
                 gripper_width_m: np.ndarray):
    """Position (N, 3) m and gripper width (N,) m interpolated linearly at the frame times ``t_s`` (s), the
    orientation by slerp (a scipy ``Rotation`` of N); ``not_finite`` when a position or width is NaN/inf."""
    from scipy.spatial.transform import Rotation, Slerp

    pos = np.stack([np.interp(t_s, pose_s, verdict.position_m[:, k]) for k in range(3)], axis=1)
    rot = Slerp(pose_s, Rotation.from_quat(verdict.quat_xyzw))(t_s)
    grip = np.interp(t_s, gripper_s, gripper_width_m)
    for name, values in (("pose position", pos), ("gripper width", grip)):
        bad = ~np.isfinite(values)
        if bad.any():
            raise ConversionError(
                f"{name} is NaN/inf at {int(bad.reshape(len(t_s), -1).any(axis=1).sum())} aligned frames",
                path,
                code="not_finite",
            )
    return pos, rot, grip
