"""Conversion of paired episodes into the ``dataset.npz`` replay buffer.

Two levels:

* :func:`align_episode` decodes one ``<STEM>_vio.mcap`` camera stream (PyAV,
  FFmpeg's H.264 decoder), resizes the frames with area averaging, and aligns
  pose and gripper width on the camera capture times (``header.timestamp``):
  position linearly, orientation by spherical linear interpolation (scipy
  ``Slerp``), gripper width linearly. Streams are trimmed to their overlap and
  ``pose_valid == false`` stretches are trimmed or rejected. The LeRobot export
  reuses this function.
* :func:`convert` runs :func:`align_episode` over the accepted episodes of a
  pairing manifest in worker processes and streams the result into one
  uncompressed ``.npz`` (layout: formats.md section 2) while hashing it, then
  writes the ``dataset.json`` sidecar and ``norm_stats.json``.

The output is never overwritten: it is written to ``.<name>.partial-<pid>`` in
the destination folder, fsynced and linked into place (``os.link`` fails when
the name exists), so a kill at any moment leaves no new file or a complete one.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import resource
import shutil
import threading
import time
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import av
import numpy as np
from av.video.reformatter import Interpolation
from scipy.spatial.transform import Rotation, Slerp

from dpflow_core import __version__
from dpflow_core.errors import ConversionError, DpflowError
from dpflow_core.files import fsync_dir, sha256_file
from dpflow_core.pairing import load_manifest, pair_recordings
from dpflow_core.recordings import read_streams
from dpflow_core.topics import DAS_DEFAULT, TopicMap

#: Version of the conversion procedure; part of every dataset's metadata and of
#: the content-addressed output folder, so a change of method never reuses an old dataset.
CONVERTER_VERSION = "1"

#: Schema version of the metadata JSON (``meta__info_json`` member and sidecar).
METADATA_VERSION = 1

INVALID_POSE_POLICIES = ("trim", "reject")

#: Member names and per-step shapes/dtypes (formats.md section 2), in the order written.
LOWDIM_KEYS = (
    "robot0_eef_pos",
    "robot0_eef_rot_axis_angle",
    "robot0_gripper_width",
    "robot0_demo_start_pose",
    "robot0_demo_end_pose",
)
_LOWDIM_WIDTH = {
    "robot0_eef_pos": 3,
    "robot0_eef_rot_axis_angle": 3,
    "robot0_gripper_width": 1,
    "robot0_demo_start_pose": 6,
    "robot0_demo_end_pose": 6,
}
_COPY_CHUNK = 8 << 20

#: swscale flags of the one-pass YUV->RGB conversion and resize: area averaging, with
#: full-resolution chroma interpolation and accurate rounding. Measured on sample
#: frames against the source resized with OpenCV INTER_AREA: mean error 2.5 levels,
#: versus 2.9 for decode-to-BGR + cv2.resize(INTER_AREA) (3.8 for plain SWS_AREA),
#: and about 1.3x faster than the OpenCV path (docs/benchmarks.md).
_SWS_FLAGS = Interpolation.AREA | Interpolation.FULL_CHR_H_INT | Interpolation.ACCURATE_RND


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
            ``rgb_dir`` was given to :func:`align_episode`.
        eef_pos: (N, 3) float32 camera0 optical-centre position, metres.
        eef_rot_axis_angle: (N, 3) float32 rotation vector, radians, norm <= pi.
        gripper_width: (N, 1) float32 metres.
        report: what was trimmed, dropped and measured (see :func:`align_episode`).
        rgb_path: the ``.npy`` file holding the decoded frames when ``rgb_dir``
            was given (rows ``rgb_rows[0]:rgb_rows[1]`` are ``rgb``), else None.
        rgb_rows: (start, stop) rows of ``rgb_path`` kept.
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


def _decode_camera(
    packets: Sequence[bytes],
    image_size: tuple[int, int] | None,
    codec: str,
    rgb_path: Path | None,
    path: Path,
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Decode H.264 access units to RGB frames.

    Each packet gets ``pts`` = its message index, so every decoded frame says
    which message (and so which capture time) it came from; packets before the
    first IDR frame produce no frame (and usually a decoder error).

    Returns:
        frames (K, H, W, 3) uint8 (a memory map when ``rgb_path`` is given; rows
        in decode order), packet index (K,) int64 of each frame, and the indices
        of packets the decoder rejected.
    """
    ctx = av.CodecContext.create(codec, "r")
    # Parallelism comes from worker processes; decoder threads did not help.
    ctx.thread_count = 1
    buf: np.ndarray | None = None
    index: list[int] = []
    errors: list[int] = []

    def take(frames: Iterable[av.VideoFrame]) -> None:
        nonlocal buf
        for frame in frames:
            if frame.pts is None or not 0 <= frame.pts < len(packets):
                raise ConversionError(f"decoder returned a frame with pts {frame.pts!r}", path, code="decode_error")
            if image_size is None:
                rgb = frame.reformat(format="rgb24", interpolation=_SWS_FLAGS).to_ndarray()
            else:
                rgb = frame.reformat(
                    width=image_size[0], height=image_size[1], format="rgb24", interpolation=_SWS_FLAGS
                ).to_ndarray()
            if buf is None:
                shape = (len(packets), *rgb.shape)
                if rgb_path is None:
                    buf = np.empty(shape, dtype=np.uint8)
                else:
                    buf = np.lib.format.open_memmap(rgb_path, mode="w+", dtype=np.uint8, shape=shape)
            buf[len(index)] = rgb
            index.append(int(frame.pts))

    for i, data in enumerate(packets):
        packet = av.Packet(data)
        packet.pts = packet.dts = i
        try:
            take(ctx.decode(packet))
        except av.error.InvalidDataError:
            errors.append(i)
    try:
        take(ctx.decode(None))
    except av.error.InvalidDataError:
        pass
    if buf is None:
        raise ConversionError(
            f"no decodable camera frame in {len(packets)} packets (no IDR frame with SPS/PPS?)",
            path,
            code="undecodable",
        )
    idx = np.asarray(index, dtype=np.int64)
    if np.any(np.diff(idx) <= 0):
        raise ConversionError("camera frames decoded out of capture order (B-frames?)", path, code="decode_error")
    return buf[: len(idx)], idx, errors


def _longest_true_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, stop) of the longest run of True in a 1-D bool array; (0, 0) when none."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, stops = edges[0::2], edges[1::2]
    if len(starts) == 0:
        return 0, 0
    k = int(np.argmax(stops - starts))
    return int(starts[k]), int(stops[k])


def _runs(mask: np.ndarray, t_s: np.ndarray) -> list[list[float]]:
    """[start_s, end_s] of each run of True in ``mask`` (times from ``t_s``)."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [[round(float(t_s[a]), 4), round(float(t_s[b - 1]), 4)] for a, b in zip(edges[0::2], edges[1::2])]


def _gaps(t_s: np.ndarray, period_s: float, factor: float = 1.5) -> list[dict]:
    """Intervals of ``t_s`` longer than ``factor`` periods."""
    dt = np.diff(t_s)
    out = []
    for i in np.flatnonzero(dt > factor * period_s):
        out.append(
            {
                "at_s": round(float(t_s[i]), 4),
                "duration_s": round(float(dt[i]), 4),
                "missing_frames": int(round(dt[i] / period_s)) - 1,
            }
        )
    return out


def align_episode(
    vio_mcap_path: str | Path,
    image_size: tuple[int, int] | None = (224, 224),
    topics: TopicMap = DAS_DEFAULT,
    invalid_pose_policy: str = "trim",
    min_overlap_fraction: float = 0.5,
    min_frames: int = 2,
    stem: str | None = None,
    rgb_dir: str | Path | None = None,
) -> AlignedEpisode:
    """Decode and align one episode on its camera frames.

    Method: the camera stream (one H.264 Annex-B access unit per message) is
    decoded with PyAV; each frame is paired with the capture time of the message
    that produced it (never by index: frames before the first IDR are lost).
    Frames are converted to RGB and resized with area averaging in one swscale
    pass (``SWS_AREA`` with full-resolution chroma, as accurate as and faster
    than decode-to-BGR + OpenCV ``INTER_AREA``). All streams are cut to the interval
    where camera, pose and gripper overlap. At each frame time the position and
    gripper width are interpolated linearly and the orientation by slerp
    (``scipy.spatial.transform.Slerp``); a frame counts as pose-invalid when
    either bracketing pose has ``pose_valid == false``.

    Args:
        vio_mcap_path: the ``<STEM>_vio.mcap`` file.
        image_size: (W, H) in pixels of the output frames; None keeps the
            camera's native resolution.
        topics: topic names of the recording.
        invalid_pose_policy: ``"trim"`` keeps the longest stretch of frames with
            valid poses (reported); ``"reject"`` rejects the episode when any frame
            inside the overlap has an invalid pose.
        min_overlap_fraction: reject the episode when the kept frames span less
            than this fraction of the recording (union of all streams).
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
        frame interval), ``coverage`` and the reader's ordering counts.

    Raises:
        RecordingError: the file cannot be read (see :func:`read_streams`).
        ConversionError: the camera is not H.264 (``not_h264``), nothing decodes
            (``undecodable``), the streams do not overlap (``no_overlap``), the
            kept frames cover too little of the recording (``low_coverage``), a
            pose is invalid under the ``reject`` policy (``pose_invalid``), too
            few frames remain (``too_short``), a position or gripper width is
            NaN/inf (``not_finite``), or an argument is invalid.
    """
    path = Path(vio_mcap_path)
    if invalid_pose_policy not in INVALID_POSE_POLICIES:
        raise ConversionError(
            f"invalid_pose_policy must be one of {INVALID_POSE_POLICIES}, got {invalid_pose_policy!r}", code="bad_option"
        )
    if image_size is not None:
        image_size = _check_image_size(image_size)
    if stem is None:
        stem = path.name.removesuffix(".mcap").removesuffix("_vio")
    streams = read_streams(path, topics)
    fmt = (streams.camera_format or "").lower()
    if fmt not in ("h264", "h.264"):
        raise ConversionError(f"camera format {streams.camera_format!r} is not H.264", path, code="not_h264")

    rgb_path = Path(rgb_dir) / f"{stem}.rgb.npy" if rgb_dir is not None else None
    frames, pkt_idx, errors = _decode_camera(streams.camera_packets, image_size, "h264", rgb_path, path)
    first_decoded = int(pkt_idx[0])
    cam_ns = streams.camera_ts_ns[pkt_idx]

    origin = int(min(streams.camera_ts_ns[0], streams.pose_ts_ns[0], streams.gripper_ts_ns[0]))
    end = int(max(streams.camera_ts_ns[-1], streams.pose_ts_ns[-1], streams.gripper_ts_ns[-1]))
    rel = lambda ns: (np.asarray(ns, dtype=np.int64) - origin) / 1e9  # noqa: E731
    span_s = max((end - origin) / 1e9, 1e-9)

    ov_start = max(int(cam_ns[0]), int(streams.pose_ts_ns[0]), int(streams.gripper_ts_ns[0]))
    ov_end = min(int(cam_ns[-1]), int(streams.pose_ts_ns[-1]), int(streams.gripper_ts_ns[-1]))
    stream_info = {
        name: {"start_s": round(float(rel(ts[0])), 4), "end_s": round(float(rel(ts[-1])), 4), "count": int(len(ts))}
        for name, ts in (("camera", cam_ns), ("pose", streams.pose_ts_ns), ("gripper", streams.gripper_ts_ns))
    }
    if ov_end <= ov_start:
        raise ConversionError(
            f"camera, pose and gripper streams do not overlap: {_fmt_streams(stream_info)}", path, code="no_overlap"
        )
    in_overlap = (cam_ns >= ov_start) & (cam_ns <= ov_end)
    lo, hi = _longest_true_run(in_overlap)

    # Pose validity at each frame: both bracketing pose samples must be valid.
    pose_t = streams.pose_ts_ns
    right = np.clip(np.searchsorted(pose_t, cam_ns, side="left"), 0, len(pose_t) - 1)
    left = np.clip(np.searchsorted(pose_t, cam_ns, side="right") - 1, 0, len(pose_t) - 1)
    frame_valid = streams.pose_valid[left] & streams.pose_valid[right]
    invalid_in_overlap = in_overlap & ~frame_valid
    invalid_info = {
        "policy": invalid_pose_policy,
        "invalid_frames": int(np.count_nonzero(invalid_in_overlap)),
        "stretches_s": _runs(invalid_in_overlap, rel(cam_ns)),
        "dropped_frames": 0,
        "dropped_s": 0.0,
    }
    if invalid_info["invalid_frames"]:
        if invalid_pose_policy == "reject":
            raise ConversionError(
                f"pose_valid is false for {invalid_info['invalid_frames']} frames "
                f"(stretches {invalid_info['stretches_s']} s) and invalid_pose_policy is 'reject'",
                path,
                code="pose_invalid",
            )
        a, b = _longest_true_run(in_overlap & frame_valid)
        kept_before = cam_ns[hi - 1] - cam_ns[lo]
        invalid_info["dropped_frames"] = int((hi - lo) - (b - a))
        invalid_info["dropped_s"] = round(float((kept_before - (cam_ns[b - 1] - cam_ns[a] if b > a else 0)) / 1e9), 4)
        lo, hi = a, b
    if hi - lo < max(min_frames, 2):
        raise ConversionError(
            f"only {hi - lo} frames remain after trimming (minimum {max(min_frames, 2)}): "
            f"{_fmt_streams(stream_info)}, pose invalid {invalid_info['stretches_s']} s",
            path,
            code="too_short",
        )
    kept_ns = cam_ns[lo:hi]
    coverage = (int(kept_ns[-1]) - int(kept_ns[0])) / 1e9 / span_s
    if coverage < min_overlap_fraction:
        raise ConversionError(
            f"the aligned frames cover only {coverage:.0%} of the recording "
            f"({(int(kept_ns[-1]) - int(kept_ns[0])) / 1e9:.2f} s of {span_s:.2f} s; minimum {min_overlap_fraction:.0%}): "
            f"{_fmt_streams(stream_info)}",
            path,
            code="low_coverage",
        )

    t0 = int(kept_ns[0])
    t_s = (kept_ns - t0) / 1e9
    pose_s = (pose_t - t0) / 1e9
    pos = np.stack([np.interp(t_s, pose_s, streams.position_m[:, k]) for k in range(3)], axis=1)
    rot = Slerp(pose_s, Rotation.from_quat(streams.quat_xyzw))(t_s)
    grip = np.interp(t_s, (streams.gripper_ts_ns - t0) / 1e9, streams.gripper_width_m)

    for name, values in (("pose position", pos), ("gripper width", grip)):
        bad = ~np.isfinite(values)
        if bad.any():
            raise ConversionError(
                f"{name} is NaN/inf at {int(bad.reshape(len(t_s), -1).any(axis=1).sum())} aligned frames",
                path,
                code="not_finite",
            )

    period = float(np.median(np.diff(t_s)))
    used_pose = (pose_t >= kept_ns[0]) & (pose_t <= kept_ns[-1])
    pose_used_s = pose_s[used_pose]
    pose_period = float(np.median(np.diff(pose_used_s))) if len(pose_used_s) > 2 else period
    report = {
        "stem": stem,
        "path": str(path),
        "camera_messages": int(len(streams.camera_packets)),
        "decoded_frames": int(len(pkt_idx)),
        "leading_undecodable_packets": first_decoded,
        "undecodable_packets": int(sum(1 for e in errors if e > first_decoded)),
        "streams": stream_info,
        "overlap_s": [round(float(rel(ov_start)), 4), round(float(rel(ov_end)), 4)],
        "trimmed_s": {
            "start": round(float(rel(kept_ns[0])), 4),
            "end": round(float((end - int(kept_ns[-1])) / 1e9), 4),
            "total": round(float(span_s - (int(kept_ns[-1]) - int(kept_ns[0])) / 1e9), 4),
        },
        "pose_invalid": invalid_info,
        "gaps": _gaps(t_s, period),
        "pose_gaps": _gaps(pose_used_s, pose_period),
        "frames": int(hi - lo),
        "duration_s": round(float(t_s[-1]), 4),
        "frequency_hz": 1.0 / period,
        "coverage": round(float(coverage), 4),
        "log_time_inversions": dict(streams.log_time_inversions),
        "duplicate_timestamps": dict(streams.duplicate_timestamps),
    }
    rgb = frames[lo:hi]
    return AlignedEpisode(
        stem=stem,
        timestamps_s=t_s,
        start_ts_ns=t0,
        camera_ts_ns=kept_ns.astype(np.int64),
        rgb=rgb,
        eef_pos=pos.astype(np.float32),
        eef_rot_axis_angle=rot.as_rotvec().astype(np.float32),
        gripper_width=grip.astype(np.float32)[:, None],
        report=report,
        rgb_path=rgb_path,
        rgb_rows=(lo, hi) if rgb_path is not None else None,
    )


def _fmt_streams(info: dict) -> str:
    return ", ".join(f"{k} {v['start_s']:.2f}-{v['end_s']:.2f} s" for k, v in info.items())


def _check_image_size(image_size: Sequence[int]) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in image_size)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"image size must be (W, H), got {image_size!r}", code="bad_option") from exc
    if not (8 <= w <= 8192 and 8 <= h <= 8192):
        raise ConversionError(f"image size {w}x{h} out of range (8..8192 pixels per side)", code="bad_option")
    return w, h


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class EpisodeInput:
    """One accepted episode of a pairing manifest.

    Attributes:
        stem: the episode's stem.
        vio_mcap: the ``<STEM>_vio.mcap`` to convert.
        size_bytes: its size recorded in the manifest (None when absent).
        sha256: its SHA-256 recorded in the manifest (None when absent).
        files: the manifest's ``files`` entry ({role: {path, size_bytes, sha256}}).
    """

    stem: str
    vio_mcap: Path
    size_bytes: int | None
    sha256: str | None
    files: dict


@dataclass
class ConversionInputs:
    """Episodes to convert, gathered from one or more manifests or task folders.

    Attributes:
        episodes: accepted episodes, in manifest order.
        rejected: episodes the pairing rejected: [{stem, path, code, reason}].
        manifests: where the manifests came from (paths, or "<in memory>").
        task: the task name when all manifests agree on one, else None.
        root: the recordings root of the first manifest.
        topics: the topic map the first manifest was paired with (its ``topics``
            dict), or None when it records none.
    """

    episodes: list[EpisodeInput]
    rejected: list[dict]
    manifests: list[str]
    task: str | None
    root: str | None
    topics: dict | None = None


def _manifest_as_dict(obj: Any) -> dict:
    if isinstance(obj, dict):
        return obj
    for attr in ("to_dict", "as_dict", "model_dump"):
        if callable(getattr(obj, attr, None)):
            return getattr(obj, attr)()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise ConversionError(f"not a manifest: {type(obj).__name__}", code="bad_manifest")


def _load_one(item: Any) -> tuple[dict, str]:
    """A manifest dict from a Manifest object, dict, manifest JSON path or task folder."""
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if path.is_dir():
            return _manifest_as_dict(pair_recordings(path)), str(path)
        if not path.exists():
            raise ConversionError("no such file or folder (expected a pairing manifest or a task folder)", path, code="bad_manifest")
        if not path.is_file():
            raise ConversionError("input is neither a manifest file nor a task folder", path, code="bad_manifest")
        return _manifest_as_dict(load_manifest(path)), str(path)
    return _manifest_as_dict(item), "<in memory>"


def load_inputs(manifest_or_paths: Any) -> ConversionInputs:
    """Gather the accepted episodes of one or more pairing manifests.

    Args:
        manifest_or_paths: a ``Manifest`` (``dpflow_core.pairing``), a manifest
            dict (``{"manifest_version": 1, "root", "task", "accepted": [...],
            "rejected": [...]}``), a manifest JSON path, a task folder (paired on
            the fly), or a list of these. Only ``accepted`` entries are converted;
            relative file paths are resolved against the manifest's ``root``.

    Raises:
        ConversionError: an input is missing or not a manifest, an accepted entry
            lacks ``files.vio_mcap.path``, or a stem appears twice (``bad_manifest``).
        PairingError: pairing a task folder or loading a manifest failed.
    """
    items = list(manifest_or_paths) if isinstance(manifest_or_paths, (list, tuple)) else [manifest_or_paths]
    if not items:
        raise ConversionError("no input manifest or task folder given", code="bad_manifest")
    episodes: list[EpisodeInput] = []
    rejected: list[dict] = []
    sources, tasks = [], set()
    root0 = None
    seen: dict[str, str] = {}
    topics = None
    for item in items:
        m, source = _load_one(item)
        if not isinstance(m, dict) or "accepted" not in m:
            raise ConversionError("manifest has no 'accepted' list", source, code="bad_manifest")
        sources.append(source)
        root = m.get("root")
        root0 = root0 or root
        topics = topics or (m.get("topics") if isinstance(m.get("topics"), dict) else None)
        if m.get("task"):
            tasks.add(m["task"])
        for entry in m.get("accepted") or []:
            stem = entry.get("stem") if isinstance(entry, dict) else None
            vio = ((entry.get("files") or {}).get("vio_mcap") or {}) if isinstance(entry, dict) else {}
            if not stem or not vio.get("path"):
                raise ConversionError(f"accepted entry {entry!r} lacks stem or files.vio_mcap.path", source, code="bad_manifest")
            if stem in seen:
                raise ConversionError(f"stem {stem!r} appears in {seen[stem]} and {source}", source, code="bad_manifest")
            seen[stem] = source
            p = Path(vio["path"])
            if not p.is_absolute() and root:
                p = Path(root) / p
            episodes.append(EpisodeInput(stem, p, vio.get("size_bytes"), vio.get("sha256"), dict(entry.get("files") or {})))
        for r in m.get("rejected") or []:
            rejected.append({"stem": r.get("stem"), "stage": "pairing", "path": r.get("path"),
                             "code": r.get("code"), "reason": r.get("reason")})
    return ConversionInputs(episodes, rejected, sources, tasks.pop() if len(tasks) == 1 else None, root0, topics)


def _topic_map(inputs: ConversionInputs) -> TopicMap:
    """The manifest's topic map when it records one (as pairing writes it), else the DAS defaults."""
    if not inputs.topics:
        return DAS_DEFAULT
    try:
        from dpflow_core.pairing import topic_map_from_dict
    except ImportError:
        return DAS_DEFAULT
    try:
        return topic_map_from_dict(inputs.topics)
    except DpflowError as exc:
        raise ConversionError(f"manifest topics are invalid: {exc.reason}", code="bad_manifest") from exc


def _conversion_options(image_size, invalid_pose_policy, min_overlap_fraction, frequency_tolerance, topics) -> dict:
    return {
        "image_size": list(image_size),
        "invalid_pose_policy": invalid_pose_policy,
        "min_overlap_fraction": min_overlap_fraction,
        "frequency_tolerance": frequency_tolerance,
        "topics": {"camera": topics.camera, "pose": topics.pose, "gripper": topics.gripper},
    }


def dataset_key(
    manifest_or_paths: Any,
    image_size: tuple[int, int],
    invalid_pose_policy: str = "trim",
    min_overlap_fraction: float = 0.5,
    frequency_tolerance: float = 0.05,
    topics: TopicMap | None = None,
) -> str:
    """Content address of the dataset a conversion would produce (64 hex digits).

    SHA-256 of the accepted inputs' stems and file hashes, the image size, the
    options that change the output and :data:`CONVERTER_VERSION`: equal keys mean
    the same conversion of the same bytes.
    """
    inputs = manifest_or_paths if isinstance(manifest_or_paths, ConversionInputs) else load_inputs(manifest_or_paths)
    topics = topics or _topic_map(inputs)
    return _key(inputs, _conversion_options(_check_image_size(image_size), invalid_pose_policy,
                                            min_overlap_fraction, frequency_tolerance, topics))


def _key(inputs: ConversionInputs, options: dict) -> str:
    doc = {
        "converter_version": CONVERTER_VERSION,
        "options": options,
        "inputs": sorted(
            [e.stem, *(f"{role}:{(e.files.get(role) or {}).get('sha256')}" for role in sorted(e.files))]
            for e in inputs.episodes
        ),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def sidecar_path_for(out_path: str | Path) -> Path:
    """The metadata sidecar beside a dataset: ``dataset.npz`` -> ``dataset.json``."""
    out = Path(out_path)
    return out.with_suffix(".json")


def norm_stats_path_for(out_path: str | Path) -> Path:
    """The norm stats file beside a dataset: ``norm_stats.json`` for ``dataset.npz``,
    ``<stem>.norm_stats.json`` for any other name (two datasets may share a folder)."""
    out = Path(out_path)
    return out.with_name("norm_stats.json" if out.stem == "dataset" else f"{out.stem}.norm_stats.json")


# --------------------------------------------------------------------------- workers


def alignment_job(
    entry: Any,
    image_size: tuple[int, int] | None,
    topics: TopicMap,
    invalid_pose_policy: str,
    min_overlap_fraction: float,
    verify_sha256: bool,
) -> dict:
    """The picklable job :func:`align_job_episode` runs in a worker for one accepted episode
    (``entry``: ``stem``, ``vio_mcap``, ``size_bytes``, ``sha256`` of :func:`load_inputs`)."""
    return {
        "stem": entry.stem,
        "vio_mcap": str(entry.vio_mcap),
        "size_bytes": entry.size_bytes,
        "sha256": entry.sha256,
        "verify_sha256": verify_sha256,
        "image_size": image_size,
        "topics": topics,
        "invalid_pose_policy": invalid_pose_policy,
        "min_overlap_fraction": min_overlap_fraction,
    }


def align_job_episode(job: dict, rgb_dir: str | Path | None) -> "AlignedEpisode":
    """Check one manifest entry's ``_vio.mcap`` against its recorded size and SHA-256, then
    :func:`align_episode` it (the shared first step of the npz conversion and the LeRobot export).

    Args:
        job: ``stem``, ``vio_mcap`` (path), ``size_bytes`` and ``sha256`` from the manifest
            (either may be None), ``verify_sha256``, ``image_size`` ((W, H) or None),
            ``topics``, ``invalid_pose_policy``, ``min_overlap_fraction``.
        rgb_dir: folder for the memory-mapped frames (None keeps them in RAM).

    Raises:
        ConversionError: ``missing_file``, or ``input_changed`` when size or SHA-256 differ
            from the manifest (the file changed since pairing); and whatever
            :func:`align_episode` raises.
    """
    path = Path(job["vio_mcap"])
    if not path.is_file():
        raise ConversionError("file not found", path, code="missing_file")
    if job["size_bytes"] is not None and path.stat().st_size != job["size_bytes"]:
        raise ConversionError(
            f"size is {path.stat().st_size} bytes but the manifest records {job['size_bytes']}: "
            "the file changed since pairing",
            path,
            code="input_changed",
        )
    if job["verify_sha256"] and job["sha256"]:
        digest = sha256_file(path)
        if digest != job["sha256"]:
            raise ConversionError(
                f"SHA-256 is {digest} but the manifest records {job['sha256']}: the file changed since pairing",
                path,
                code="input_changed",
            )
    return align_episode(
        path,
        tuple(job["image_size"]) if job["image_size"] is not None else None,
        topics=job["topics"],
        invalid_pose_policy=job["invalid_pose_policy"],
        min_overlap_fraction=job["min_overlap_fraction"],
        stem=job["stem"],
        rgb_dir=rgb_dir,
    )


def _episode_job(job: dict) -> dict:
    """Worker: align one episode and write its arrays as ``.npy`` files in ``job['dir']``.

    Returns a small summary (paths, lengths, report, value ranges); a rejected
    episode returns ``{"ok": False, code, reason}``. Arrays never travel through
    the pipe.
    """
    started = time.perf_counter()
    stem, path, out_dir = job["stem"], Path(job["vio_mcap"]), Path(job["dir"])
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        ep = align_job_episode(job, out_dir)
        n = len(ep)
        arrays = {
            "timestamp": ep.timestamps_s.astype(np.float64),
            "robot0_eef_pos": ep.eef_pos,
            "robot0_eef_rot_axis_angle": ep.eef_rot_axis_angle,
            "robot0_gripper_width": ep.gripper_width,
            "robot0_demo_start_pose": np.repeat(ep.start_pose[None], n, axis=0),
            "robot0_demo_end_pose": np.repeat(ep.end_pose[None], n, axis=0),
        }
        files = {}
        for key, arr in arrays.items():
            files[key] = str(out_dir / f"{key}.npy")
            np.save(files[key], np.ascontiguousarray(arr))
        ranges = {
            key: {"min": np.min(arr, axis=0).tolist(), "max": np.max(arr, axis=0).tolist()}
            for key, arr in arrays.items()
            if key != "timestamp"
        }
        # The parent reads the frames back with read(): the page cache makes them visible without msync.
        ranges["camera0_rgb"] = {"min": int(ep.rgb.min()), "max": int(ep.rgb.max())}
        return {
            "ok": True,
            "stem": stem,
            "n": n,
            "rgb_path": str(ep.rgb_path),
            "rgb_rows": list(ep.rgb_rows),
            "files": files,
            "report": ep.report,
            "ranges": ranges,
            "seconds": time.perf_counter() - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    except DpflowError as exc:
        return {"ok": False, "stem": stem, "path": exc.path or str(path), "code": exc.code, "reason": exc.reason}


def _run_jobs(jobs: list[dict], workers: int, progress: Callable | None) -> list[dict]:
    """Run episode jobs (in worker processes when ``workers`` > 1); one summary per job, in job order.

    An exception inside a job (or a worker process that dies) becomes a rejection
    of that episode with the exception's type and message; none is lost.
    """
    results: list[dict | None] = [None] * len(jobs)
    done = 0

    def failed(job: dict, exc: BaseException) -> dict:
        return {"ok": False, "stem": job["stem"], "path": job["vio_mcap"], "code": "internal_error",
                "reason": f"{type(exc).__name__}: {exc}"}

    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            try:
                results[i] = _episode_job(job)
            except Exception as exc:  # noqa: BLE001 - reported per episode
                results[i] = failed(job, exc)
            done += 1
            if progress:
                progress("episodes", done, len(jobs))
        return results  # type: ignore[return-value]

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dpflow_core.conversion"])
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        futures = {pool.submit(_episode_job, job): i for i, job in enumerate(jobs)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported per episode
                results[i] = failed(jobs[i], exc)
            done += 1
            if progress:
                progress("episodes", done, len(jobs))
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- writing


class _HashingWriter:
    """Write-only stream that feeds every byte to SHA-256 on its way to the file.

    It cannot seek, so :mod:`zipfile` writes each member's sizes and CRC in a
    data descriptor after the data instead of seeking back into bytes that were
    already hashed. Every ``sync_every`` bytes a background thread runs
    ``fdatasync`` so that the disk writes overlap hashing instead of all waiting
    for the final ``fsync``.
    """

    def __init__(self, raw, sync_every: int = 64 << 20):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.pos = 0
        self._sync_every = sync_every
        self._synced_at = 0
        self._sync_thread: threading.Thread | None = None

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.raw.write(view)
        self.pos += view.nbytes
        if self.pos - self._synced_at >= self._sync_every and not (self._sync_thread and self._sync_thread.is_alive()):
            self._synced_at = self.pos
            self.raw.flush()
            self._sync_thread = threading.Thread(target=os.fdatasync, args=(self.raw.fileno(),), daemon=True)
            self._sync_thread.start()
        return view.nbytes

    def join(self) -> None:
        """Wait for a background ``fdatasync`` still running."""
        if self._sync_thread is not None:
            self._sync_thread.join()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    )
    return buf.getvalue()


@dataclass
class _Member:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # (file, byte offset, byte count, delete the file once copied) pieces in order, or in-memory bytes
    pieces: list[tuple[str, int, int, bool]] = field(default_factory=list)
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data) if self.data is not None else sum(p[2] for p in self.pieces)


def _write_npz(path: Path, members: list[_Member], progress: Callable | None) -> tuple[str, int]:
    """Stream members into a new uncompressed zip at ``path``; return (sha256 hex, size in bytes).

    Raises:
        FileExistsError: ``path`` exists.
    """
    total = sum(m.nbytes for m in members)
    written = 0
    with open(path, "xb") as f:
        out = _HashingWriter(f)
        with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for m in members:
                info = zipfile.ZipInfo(m.name + ".npy", date_time=time.localtime()[:6])
                info.compress_type = zipfile.ZIP_STORED
                info.external_attr = 0o644 << 16
                with zf.open(info, mode="w", force_zip64=True) as dst:
                    dst.write(_npy_header(m.shape, m.dtype))
                    if m.data is not None:
                        dst.write(m.data)
                        written += len(m.data)
                    for src_path, offset, count, drop in m.pieces:
                        with open(src_path, "rb") as src:
                            src.seek(offset)
                            left = count
                            while left:
                                chunk = src.read(min(_COPY_CHUNK, left))
                                if not chunk:
                                    raise ConversionError(f"temporary file ended {left} bytes early", src_path)
                                dst.write(chunk)
                                left -= len(chunk)
                                written += len(chunk)
                                if progress:
                                    progress("write", written, total)
                        if drop:
                            # Deleting a copied scratch file drops its dirty pages before they reach the disk.
                            os.unlink(src_path)
        f.flush()
        out.join()
        os.fsync(f.fileno())
        size = f.tell()
    if size != out.pos:
        raise ConversionError(f"wrote {out.pos} bytes but the file holds {size}", path)
    return out.sha256.hexdigest(), size


def _npy_data_offset(path: str) -> int:
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(folder: Path, names: Iterable[str]) -> list[str]:
    """Remove ``.<name>.partial-<pid>`` / ``.<name>.work-<pid>`` left by killed conversions."""
    removed = []
    names = set(names)
    for entry in folder.glob(".*"):
        base, sep, pid = entry.name[1:].rpartition("-")
        stem, dot, kind = base.rpartition(".")
        if sep and dot and kind in ("partial", "work") and stem in names and pid.isdigit() and not _pid_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def _install(tmp: Path, final: Path, backup_to: Path | None) -> None:
    """Put ``tmp`` at ``final`` without ever overwriting: hard link (fails when ``final`` exists)
    then unlink ``tmp``. With ``backup_to``, an existing ``final`` is first linked there and
    then atomically replaced, so ``final`` is never missing."""
    if backup_to is not None and final.exists():
        os.link(final, backup_to)
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final)
    except FileExistsError as exc:
        raise ConversionError("output appeared while converting; it was left untouched", final, code="output_exists") from exc
    except OSError:
        # File systems without hard links: check, then rename (a narrow race instead of none).
        if final.exists():
            raise ConversionError("output exists; it was left untouched", final, code="output_exists")
        os.replace(tmp, final)
        return
    tmp.unlink()


def _backup_name(path: Path, stamp: str) -> Path:
    return path.with_name(f"{path.stem}.bak-{stamp}{path.suffix}")


def _write_json_atomic(path: Path, doc: dict) -> Path:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


# --------------------------------------------------------------------------- convert


@dataclass
class ConversionResult:
    """What :func:`convert` produced.

    Attributes:
        path: the ``dataset.npz``.
        sha256: SHA-256 (hex) of ``path``, computed while writing.
        size_bytes: size of ``path``.
        sidecar_path: the metadata JSON beside it (``dataset.json``).
        norm_stats_path: the ``norm_stats.json`` beside it.
        frequency_hz: measured dataset frequency (1 / median frame interval).
        n_episodes: episodes in the dataset; total_steps: T.
        image_size: (W, H) pixels.
        rejected: episodes left out, with stage, code and reason.
        wall_time_s: seconds the conversion took.
        metadata: the metadata document (as in the sidecar).
        reused: True when an identical existing dataset was returned instead.
    """

    path: Path
    sha256: str
    size_bytes: int
    sidecar_path: Path
    norm_stats_path: Path
    frequency_hz: float
    n_episodes: int
    total_steps: int
    image_size: tuple[int, int]
    rejected: list[dict]
    wall_time_s: float
    metadata: dict
    reused: bool = False

    @property
    def frames_per_s(self) -> float:
        """Converted frames per second of wall time."""
        return self.total_steps / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def contract(self) -> dict:
        """The ``dataset_npz`` asset value (plain dict; see the data contract)."""
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "sidecar_path": str(self.sidecar_path),
            "norm_stats_path": str(self.norm_stats_path),
            "frequency_hz": self.frequency_hz,
            "n_episodes": self.n_episodes,
            "total_steps": self.total_steps,
            "image_size": list(self.image_size),
        }


def _result_from_sidecar(out: Path, sidecar: Path, norm: Path, meta: dict, reused: bool) -> ConversionResult:
    return ConversionResult(
        path=out,
        sha256=meta["sha256"],
        size_bytes=int(meta["size_bytes"]),
        sidecar_path=sidecar,
        norm_stats_path=norm,
        frequency_hz=float(meta["frequency_hz"]),
        n_episodes=int(meta["n_episodes"]),
        total_steps=int(meta["total_steps"]),
        image_size=tuple(meta["image_size"]),
        rejected=list(meta.get("rejected", [])),
        wall_time_s=float(meta.get("wall_time_s", 0.0)),
        metadata=meta,
        reused=reused,
    )


def _reject_reasons(rejected: list[dict], limit: int = 20) -> str:
    parts = [f"{r['stem']}: {r['reason']}" for r in rejected[:limit]]
    if len(rejected) > limit:
        parts.append(f"... {len(rejected) - limit} more")
    return "; ".join(parts)


def convert(
    manifest_or_paths: Any,
    out_path: str | Path,
    image_size: tuple[int, int] = (224, 224),
    workers: int = 0,
    backup: bool = False,
    invalid_pose_policy: str = "trim",
    min_overlap_fraction: float = 0.5,
    frequency_tolerance: float = 0.05,
    topics: TopicMap | None = None,
    verify_sha256: bool = True,
    reuse_existing: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> ConversionResult:
    """Convert the accepted episodes of a pairing manifest into one ``dataset.npz``.

    Each episode goes through :func:`align_episode` in a worker process and is
    written to temporary ``.npy`` files beside the output; the parent then
    streams them, in manifest order, into an uncompressed zip (formats.md
    section 2 members, plus ``meta__info_json``: the metadata as 1-D uint8 JSON)
    while computing its SHA-256. Memory stays bounded by one episode per worker.
    The dataset frequency is 1 / the median frame interval over all episodes;
    an episode whose own frequency differs from the median episode frequency by
    more than ``frequency_tolerance`` (relative) is rejected with the numbers.

    Metadata (the same document in ``meta__info_json`` and in the sidecar):
    episode count, total steps, episode lengths (min/mean/max) and per-episode
    reports (length, frequency, trimmed seconds, gaps, pose-invalid handling),
    measured frequency, image size, member shapes and dtypes, value ranges, the
    input manifest (stems and file SHA-256), rejected episodes with reasons,
    options, converter version and ``dataset_key``. Values known only once the
    file is complete (``sha256``, ``size_bytes``, the final ``wall_time_s`` and
    ``timings_s``) are null or partial in the member and filled in the sidecar.

    Args:
        manifest_or_paths: see :func:`load_inputs` (manifest, dict, path, task folder, or a list).
        out_path: the ``.npz`` to create. ``dataset.json`` (metadata) and
            ``norm_stats.json`` (:func:`dpflow_core.dataset.compute_norm_stats`)
            are written beside it (:func:`sidecar_path_for`, :func:`norm_stats_path_for`).
        image_size: (W, H) pixels of ``data__camera0_rgb``.
        workers: worker processes; 0 = the number of CPU cores.
        backup: when the output exists, keep it as ``<stem>.bak-<UTC time><suffix>``
            (hard link) and replace it atomically; otherwise an existing output is an error.
        invalid_pose_policy, min_overlap_fraction: see :func:`align_episode`.
        topics: topic names; default: the manifest's ``topics``, else the DAS defaults.
        frequency_tolerance: relative tolerance of an episode's frequency.
        verify_sha256: hash each input and compare with the manifest before converting.
        reuse_existing: when the output exists and its sidecar records the same
            :func:`dataset_key` and file size, return it (``reused=True``) instead of failing.
        progress: called as ``progress(stage, done, total)`` with stage
            ``"episodes"`` (episodes aligned) or ``"write"`` (bytes written).

    Returns:
        The output paths, hash and figures.

    Raises:
        ConversionError: the output (or its sidecar / norm stats) exists
            (``output_exists``); no episode survived (``no_valid_episodes``: "no
            valid episodes: N found, N rejected: reasons"); a bad option or manifest.
        PairingError: a manifest file is missing or malformed, or a task folder cannot be paired.
        DatasetError: the written dataset fails validation or its norm stats
            cannot be computed (zero-variance dimension, non-finite values); the
            output is then not created.
    """
    started = time.perf_counter()
    image_size = _check_image_size(image_size)
    if invalid_pose_policy not in INVALID_POSE_POLICIES:
        raise ConversionError(
            f"invalid_pose_policy must be one of {INVALID_POSE_POLICIES}, got {invalid_pose_policy!r}", code="bad_option"
        )
    if not 0 < frequency_tolerance < 1:
        raise ConversionError(f"frequency_tolerance must be in (0, 1), got {frequency_tolerance}", code="bad_option")
    out = Path(out_path).absolute()
    if out.suffix != ".npz":
        raise ConversionError("output must end in .npz", out, code="bad_option")
    folder = out.parent
    sidecar, norm_path = sidecar_path_for(out), norm_stats_path_for(out)
    inputs = load_inputs(manifest_or_paths)
    topics = topics or _topic_map(inputs)
    options = _conversion_options(image_size, invalid_pose_policy, min_overlap_fraction, frequency_tolerance, topics)
    key = _key(inputs, options)

    existing = [p for p in (out, sidecar, norm_path) if p.exists()]
    if existing and reuse_existing and out.exists() and sidecar.exists() and norm_path.exists():
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConversionError(f"existing sidecar is unreadable: {exc}", sidecar, code="output_exists") from exc
        if meta.get("dataset_key") == key and meta.get("size_bytes") == out.stat().st_size:
            return _result_from_sidecar(out, sidecar, norm_path, meta, reused=True)
        raise ConversionError(
            "output exists and is a different dataset (its sidecar records another input/option key or size)",
            out,
            code="output_exists",
        )
    if existing and not backup:
        raise ConversionError(
            f"refusing to overwrite existing {', '.join(p.name for p in existing)}; choose another path or pass --backup",
            out,
            code="output_exists",
        )
    n_found = len(inputs.episodes) + len(inputs.rejected)
    if not inputs.episodes:
        raise ConversionError(
            f"no valid episodes: {n_found} found, {len(inputs.rejected)} rejected: {_reject_reasons(inputs.rejected)}",
            inputs.manifests[0] if inputs.manifests else None,
            code="no_valid_episodes",
        )

    folder.mkdir(parents=True, exist_ok=True)
    stale = _remove_stale(folder, (out.name, sidecar.name, norm_path.name))
    pid = os.getpid()
    partial = folder / f".{out.name}.partial-{pid}"
    work = folder / f".{out.name}.work-{pid}"
    made: list[Path] = []
    try:
        work.mkdir()
        n_workers = workers if workers and workers > 0 else (os.cpu_count() or 1)
        jobs = [
            alignment_job(e, image_size, topics, invalid_pose_policy, min_overlap_fraction, verify_sha256)
            | {"dir": str(work / f"{i:06d}")}
            for i, e in enumerate(inputs.episodes)
        ]
        t_jobs = time.perf_counter()
        results = _run_jobs(jobs, n_workers, progress)
        timings = {"episodes": round(time.perf_counter() - t_jobs, 3)}
        rejected = list(inputs.rejected)
        ok = []
        for r in results:
            if r["ok"]:
                ok.append(r)
            else:
                rejected.append({"stem": r["stem"], "stage": "conversion", "path": r["path"], "code": r["code"],
                                 "reason": r["reason"]})

        if ok:
            ref_hz = float(np.median([r["report"]["frequency_hz"] for r in ok]))
            kept = []
            for r in ok:
                f_hz = r["report"]["frequency_hz"]
                dev = abs(f_hz - ref_hz) / ref_hz
                if dev > frequency_tolerance:
                    rejected.append({
                        "stem": r["stem"], "stage": "conversion", "path": r["report"]["path"], "code": "frequency_mismatch",
                        "reason": f"measured {f_hz:.3f} Hz differs from the dataset's {ref_hz:.3f} Hz by {dev:.1%} "
                                  f"(tolerance {frequency_tolerance:.1%})",
                    })
                else:
                    kept.append(r)
            ok = kept
        if not ok:
            raise ConversionError(
                f"no valid episodes: {n_found} found, {len(rejected)} rejected: {_reject_reasons(rejected)}",
                inputs.manifests[0] if inputs.manifests else None,
                code="no_valid_episodes",
            )

        dts = np.concatenate([np.diff(np.load(r["files"]["timestamp"])) for r in ok])
        frequency_hz = float(1.0 / np.median(dts))
        lengths = np.array([r["n"] for r in ok], dtype=np.int64)
        episode_ends = np.cumsum(lengths).astype(np.int64)
        total = int(episode_ends[-1])
        w, h = image_size

        members = [_Member("meta__episode_ends", episode_ends.shape, np.dtype(np.int64), data=episode_ends.tobytes())]
        for k in ("timestamp", *LOWDIM_KEYS):
            dtype = np.dtype(np.float64 if k == "timestamp" else np.float32)
            shape = (total,) if k == "timestamp" else (total, _LOWDIM_WIDTH[k])
            pieces = []
            for r in ok:
                f_ = r["files"][k]
                pieces.append((f_, _npy_data_offset(f_), r["n"] * dtype.itemsize * (1 if k == "timestamp" else _LOWDIM_WIDTH[k]), False))
            members.append(_Member("data__" + k, shape, dtype, pieces))
        row = h * w * 3
        rgb_pieces = []
        for r in ok:
            a, b = r["rgb_rows"]
            rgb_pieces.append((r["rgb_path"], _npy_data_offset(r["rgb_path"]) + a * row, (b - a) * row, True))
        members.append(_Member("data__camera0_rgb", (total, h, w, 3), np.dtype(np.uint8), rgb_pieces))

        stamp = datetime.now(timezone.utc)
        meta = _metadata(inputs, ok, rejected, options, key, frequency_hz, lengths, image_size, members, stamp, stale)
        meta["workers"] = n_workers
        meta["timings_s"] = dict(timings)
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        info = json.dumps(meta).encode()
        members.append(_Member("meta__info_json", (len(info),), np.dtype(np.uint8), data=info))

        made.append(partial)
        t_write = time.perf_counter()
        sha256, size = _write_npz(partial, members, progress)
        shutil.rmtree(work, ignore_errors=True)
        timings["write"] = round(time.perf_counter() - t_write, 3)

        from dpflow_core.dataset import compute_norm_stats

        t_stats = time.perf_counter()
        stats = compute_norm_stats(partial, sha256=sha256)
        timings["norm_stats"] = round(time.perf_counter() - t_stats, 3)
        meta["timings_s"] = {**timings, "total": round(time.perf_counter() - started, 3)}
        meta["sha256"], meta["size_bytes"] = sha256, size
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        norm_tmp = _write_json_atomic(norm_path, stats)
        made.append(norm_tmp)
        side_tmp = _write_json_atomic(sidecar, meta)
        made.append(side_tmp)

        suffix = stamp.strftime("%Y%m%dT%H%M%SZ")
        # The npz goes last: when it exists, its sidecar and norm stats exist too.
        for tmp, final in ((norm_tmp, norm_path), (side_tmp, sidecar), (partial, out)):
            _install(tmp, final, _backup_name(final, suffix) if backup else None)
            made.remove(tmp)
            if not backup and final is not out:
                made.append(final)
        fsync_dir(folder)
        made.clear()
    finally:
        for p in made:
            # Reached only on failure: remove what this call created, never a pre-existing output.
            p.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return _result_from_sidecar(out, sidecar, norm_path, meta, reused=False)


def _metadata(inputs, ok, rejected, options, key, frequency_hz, lengths, image_size, members, stamp, stale) -> dict:
    ranges: dict[str, dict] = {}
    for r in ok:
        for k, v in r["ranges"].items():
            if k not in ranges:
                ranges[k] = {"min": v["min"], "max": v["max"]}
            else:
                ranges[k]["min"] = np.minimum(ranges[k]["min"], v["min"]).tolist()
                ranges[k]["max"] = np.maximum(ranges[k]["max"], v["max"]).tolist()
    by_stem = {e.stem: e for e in inputs.episodes}
    episodes, start = [], 0
    for r in ok:
        rep = r["report"]
        episodes.append({
            "stem": r["stem"],
            "start": start,
            "length": r["n"],
            "frequency_hz": rep["frequency_hz"],
            "duration_s": rep["duration_s"],
            "trimmed_s": rep["trimmed_s"],
            "coverage": rep["coverage"],
            "gaps": rep["gaps"],
            "pose_gaps": rep["pose_gaps"],
            "pose_invalid": rep["pose_invalid"],
            "leading_undecodable_packets": rep["leading_undecodable_packets"],
            "undecodable_packets": rep["undecodable_packets"],
            "convert_seconds": round(r["seconds"], 3),
            "worker_peak_rss_mb": round(r["peak_rss_mb"], 1),
        })
        start += r["n"]
    return {
        "metadata_version": METADATA_VERSION,
        "format": "replay_buffer_npz",
        "converter": {"name": "dpflow.conversion", "version": CONVERTER_VERSION, "dpflow_version": __version__,
                      "pyav": av.__version__, "numpy": np.__version__},
        "created_at": stamp.isoformat(timespec="seconds"),
        "task": inputs.task,
        "dataset_key": key,
        "n_episodes": int(len(lengths)),
        "total_steps": int(lengths.sum()),
        "episode_lengths": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())},
        "frequency_hz": frequency_hz,
        "image_size": list(image_size),
        "pose": "camera0 optical centre from VIO; position in m, rotation vector in rad (norm <= pi)",
        "timestamp": "seconds from each episode's first frame (camera header.timestamp)",
        "keys": {m.name: {"shape": list(m.shape), "dtype": str(m.dtype)} for m in members},
        "value_ranges": ranges,
        "episodes": episodes,
        "inputs": {
            "manifests": inputs.manifests,
            "root": inputs.root,
            "episodes": [{"stem": r["stem"], "files": by_stem[r["stem"]].files} for r in ok],
        },
        "rejected": rejected,
        "options": options,
        "stale_files_removed": stale,
        "workers": None,
        "timings_s": None,
        "wall_time_s": None,
        "sha256": None,
        "size_bytes": None,
    }
