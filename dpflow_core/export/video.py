"""Video: H.264 episode videos as LeRobot reads them (PyAV).

Takes frames (uint8, ``(T, H, W, 3)`` RGB) and the fps; gives an MP4 whose frame ``i`` is stored at
``i / fps`` s (yuv420p), a retimed copy of an existing video, and a video's ``info`` block.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from dpflow_core.errors import STORAGE_ERRNOS, ConversionError


#: Time base of the MP4 video streams: frame i is stored at round(i * 90000 / fps) ticks,
#: within 5.6 microseconds of i / fps (LeRobot's video tolerance is 100 microseconds).
_VIDEO_TIME_BASE = Fraction(1, 90_000)


def _disk_at_fault(exc: Exception) -> bool:
    """PyAV raises the OS's write errors as ``av.error.OSError`` (an ``FFmpegError`` and an ``OSError``): a full,
    read-only or forbidden disk passes on as it is, for the export to name its folder (``StorageError``)."""
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS | {errno.EACCES, errno.EPERM}


@dataclass(frozen=True)
class VideoSpec:
    """How camera frames are encoded (PyAV, libx264).

    Attributes:
        codec: FFmpeg encoder name.
        pix_fmt: pixel format of the stream (yuv420p plays everywhere).
        crf: constant rate factor (lower is better quality, larger files).
        gop_size: frames between key frames; small values make random access
            cheap (LeRobot's loaders seek to a key frame and decode forward).
        preset: x264 speed preset.
    """

    codec: str = "libx264"
    pix_fmt: str = "yuv420p"
    crf: int = 23
    gop_size: int = 2
    preset: str = "veryfast"


# --------------------------------------------------------------------------- video


def encode_video(path: str | Path, frames: np.ndarray, fps: float, spec: VideoSpec = VideoSpec()) -> None:
    """Encode RGB frames to an MP4 (H.264) with frame i at time i / ``fps``.

    Args:
        path: output ``.mp4`` (its folder must exist).
        frames: (N, H, W, 3) uint8 RGB, H and W even (yuv420p).
        fps: frame rate, Hz (need not be an integer).
        spec: encoder settings.

    Raises:
        ConversionError: when a frame size is odd or the encoder fails.
    """
    n, h, w = frames.shape[:3]
    if h % 2 or w % 2:
        raise ConversionError(f"video size {w}x{h} must be even for {spec.pix_fmt}", path)
    ticks = _VIDEO_TIME_BASE.denominator / fps
    try:
        with av.open(str(path), "w", format="mp4") as container:
            stream = container.add_stream(spec.codec, rate=Fraction(fps).limit_denominator(100_000))
            stream.width, stream.height, stream.pix_fmt = w, h, spec.pix_fmt
            stream.time_base = _VIDEO_TIME_BASE
            stream.codec_context.time_base = _VIDEO_TIME_BASE
            stream.codec_context.gop_size = spec.gop_size
            stream.codec_context.max_b_frames = 0
            stream.options = {"crf": str(spec.crf), "preset": spec.preset, "bf": "0"}
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
                frame.pts = round(i * ticks)
                frame.time_base = _VIDEO_TIME_BASE
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
    except (av.FFmpegError, ValueError) as exc:
        if _disk_at_fault(exc):
            raise
        raise ConversionError(f"video encoding failed: {exc}", path) from exc


def retime_video(src: str | Path, dst: str | Path, fps: float) -> int:
    """Copy an MP4 without re-encoding, storing frame i at time i / ``fps``.

    The frame order is the presentation order of ``src`` (no B-frames, so decode
    order equals presentation order).

    Returns:
        The number of frames written.

    Raises:
        ConversionError: when ``src`` cannot be read or has no video stream.
    """
    ticks = _VIDEO_TIME_BASE.denominator / fps
    try:
        with av.open(str(src)) as ic, av.open(str(dst), "w", format="mp4") as oc:
            if not ic.streams.video:
                raise ConversionError("no video stream", src)
            ins = ic.streams.video[0]
            out = oc.add_stream_from_template(ins)
            out.time_base = _VIDEO_TIME_BASE
            packets = [p for p in ic.demux(ins) if p.size]
            order = sorted(range(len(packets)), key=lambda k: packets[k].pts)
            rank = np.empty(len(packets), dtype=np.int64)
            rank[order] = np.arange(len(packets))
            for k, packet in enumerate(packets):
                packet.pts = packet.dts = round(int(rank[k]) * ticks)
                packet.time_base = _VIDEO_TIME_BASE
                packet.stream = out
                oc.mux(packet)
            return len(packets)
    except av.FFmpegError as exc:
        if _disk_at_fault(exc):
            raise
        raise ConversionError(f"cannot rewrite video timestamps: {exc}", src) from exc


def concat_videos(sources: list[str | Path], dst: str | Path, fps: float) -> list[int]:
    """Concatenate MP4s without re-encoding (v3.0's many episodes per file), frame k of the result at k / ``fps``.

    Each source must start with a key frame (every :func:`encode_video` output does) and carry
    the same codec parameters (size, pixel format, SPS/PPS) as the first, so that a decoder
    seeking to an episode's first frame needs nothing from the episode before.

    Args:
        sources: the episode videos, in order.
        dst: the ``.mp4`` to write.
        fps: frame rate, Hz.

    Returns:
        The number of frames taken from each source.

    Raises:
        ConversionError: when a source is unreadable, has no video stream, or its codec
            parameters differ from the first source's.
    """
    ticks = _VIDEO_TIME_BASE.denominator / fps
    counts: list[int] = []
    try:
        with av.open(str(dst), "w", format="mp4") as oc:
            out = None
            extradata = None
            k = 0
            for src in sources:
                with av.open(str(src)) as ic:
                    if not ic.streams.video:
                        raise ConversionError("no video stream", src)
                    ins = ic.streams.video[0]
                    params = (ins.codec_context.extradata, ins.codec_context.width, ins.codec_context.height)
                    if out is None:
                        out = oc.add_stream_from_template(ins)
                        out.time_base = _VIDEO_TIME_BASE
                        extradata = params
                    elif params != extradata:
                        raise ConversionError(f"codec parameters differ from those of {sources[0]}: cannot concatenate", src)
                    packets = [p for p in ic.demux(ins) if p.size]
                    rank = np.empty(len(packets), dtype=np.int64)
                    rank[sorted(range(len(packets)), key=lambda j: packets[j].pts)] = np.arange(len(packets))
                    for j, packet in enumerate(packets):
                        packet.pts = packet.dts = round((k + int(rank[j])) * ticks)
                        packet.time_base = _VIDEO_TIME_BASE
                        packet.stream = out
                        oc.mux(packet)
                    k += len(packets)
                    counts.append(len(packets))
    except av.FFmpegError as exc:
        if _disk_at_fault(exc):
            raise
        raise ConversionError(f"cannot concatenate videos: {exc}", dst) from exc
    return counts


def video_info(path: str | Path, fps: float) -> dict:
    """The ``info`` block of a LeRobot video feature, read from the written file.

    Returns:
        ``{"video.fps", "video.height", "video.width", "video.codec",
        "video.pix_fmt", "video.is_depth_map", "video.channels", "has_audio"}``.
    """
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        return {
            "video.fps": fps,
            "video.height": s.height,
            "video.width": s.width,
            "video.codec": s.codec_context.codec.canonical_name,
            "video.pix_fmt": s.pix_fmt,
            "video.is_depth_map": False,
            "video.channels": 3,
            "has_audio": bool(c.streams.audio),
        }
