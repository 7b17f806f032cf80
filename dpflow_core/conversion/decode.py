"""Camera decoding: H.264 access units in, RGB frames resized in one swscale pass out.

Takes one episode's access units (``bytes``, capture order) and the image size (W, H pixels);
gives uint8 ``(K, H, W, 3)`` frames, in memory or streamed to a scratch ``.npy`` file with plain
writes (:class:`FrameFile`: nothing the size of the episode stays in the process), the packet
index of each frame, the packets the decoder rejected and each frame's pixel range.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

import av
import numpy as np
from av.video.reformatter import Interpolation, VideoReformatter

from dpflow_core.errors import ConversionError
from dpflow_core.recordings.plausibility import frame_motion

#: swscale flags of the one-pass YUV->RGB conversion and resize: area averaging, with
#: full-resolution chroma interpolation and accurate rounding. Measured on sample
#: frames against the source resized with OpenCV INTER_AREA: mean error 2.5 levels,
#: versus 2.9 for decode-to-BGR + cv2.resize(INTER_AREA) (3.8 for plain SWS_AREA),
#: and about 1.3x faster than the OpenCV path (docs/benchmarks.md).
_SWS_FLAGS = Interpolation.AREA | Interpolation.FULL_CHR_H_INT | Interpolation.ACCURATE_RND


class FrameFile:
    """Frames appended to a ``.npy`` file with plain ``write()`` calls, never memory-mapped while
    written, so they live in the page cache (evictable, written back or dropped with the file)
    rather than as dirty pages of this process: peak RSS does not grow with the episode.

    The header first declares ``capacity`` rows; :meth:`close` rewrites it, at the same length
    (space padding, as NEP 1 allows), for the rows actually written. ``prefix_crc32[k]`` is the
    zip CRC-32 (:func:`zlib.crc32`) of the first ``k`` rows' bytes (header excluded), kept while
    writing so that the dataset writer never reads the frames again for its CRC: the CRC of rows
    ``a:b`` is ``crc32_combine(prefix_crc32[a], prefix_crc32[b], (b - a) * row bytes)``.
    """

    def __init__(self, path: Path, frame_shape: tuple[int, ...], capacity: int):
        self.path, self.frame_shape, self.rows = path, frame_shape, 0
        self.prefix_crc32 = [0]
        self._header = self._header_for(capacity)
        self._f = open(path, "xb")
        self._f.write(self._header)

    def _header_for(self, rows: int, length: int | None = None) -> bytes:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buf, {"descr": "|u1", "fortran_order": False, "shape": (rows, *self.frame_shape)})
        head = buf.getvalue()
        if length is None or len(head) == length:
            return head
        # Same total length as the first header: pad the dict with spaces before its newline.
        body = head[10:-1].rstrip(b" ")
        return head[:8] + (length - 10).to_bytes(2, "little") + body + b" " * (length - 11 - len(body)) + b"\n"

    def append(self, rgb: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(rgb)).cast("B")
        self._f.write(data)
        self.prefix_crc32.append(zlib.crc32(data, self.prefix_crc32[-1]))
        self.rows += 1

    def close(self) -> None:
        self._f.seek(0)
        self._f.write(self._header_for(self.rows, len(self._header)))
        self._f.close()

    def abort(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


def decode_camera(
    packets: Sequence[bytes],
    image_size: tuple[int, int] | None,
    codec: str,
    rgb_path: Path | None,
    path: Path,
    ts_ns: np.ndarray | None = None,
    on_frame: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray, np.ndarray | None, np.ndarray]:
    """Decode H.264 access units to RGB frames.

    Each packet gets ``pts`` = its message index, so every decoded frame says
    which message (and so which capture time) it came from; packets before the
    first IDR frame produce no frame (and usually a decoder error). Every packet
    is decoded, in order, even when ``ts_ns`` repeats a capture time (a later frame
    may reference it); a frame whose capture time equals the previous kept frame's is
    then dropped, so the kept frames are bit-identical to a full decode.

    Frames are converted to RGB and resized by one ``VideoReformatter`` (one swscale context,
    :data:`_SWS_FLAGS`) for the whole stream: bit-identical to ``VideoFrame.reformat`` per frame.

    With ``rgb_path`` the frames stream to that ``.npy`` file as they are decoded
    (:class:`FrameFile`) and are returned as a read-only memory map of it: nothing the
    size of the episode is held in this process. ``on_frame`` receives each kept (H, W, 3) RGB frame,
    in order, while it is in memory (the image motion of :mod:`dpflow_core.offsets`).

    Returns:
        frames (K, H, W, 3) uint8 (a read-only memory map when ``rgb_path`` is given; rows
        in decode order), packet index (K,) int64 of each frame, the indices
        of packets the decoder rejected, (K, 2) uint8 per-frame (min, max) pixel values, and with
        ``rgb_path`` the (K + 1,) int64 CRC-32 of the file's first k rows (:attr:`FrameFile.prefix_crc32`),
        else None; and (K,) float32 image change of each frame against the one before
        (:func:`~dpflow_core.recordings.plausibility.frame_motion`, grey levels; 0 for the first).
    """
    ctx = av.CodecContext.create(codec, "r")
    # Parallelism comes from worker processes; decoder threads did not help.
    ctx.thread_count = 1
    # One scaler for the whole stream: ``VideoFrame.reformat`` gives every frame a new swscale
    # context, whose set-up (the area filter's coefficients) costs about a third of the scaling
    # itself at 640x480 -> 224x224; the pixels are the same either way (docs/benchmarks.md).
    scaler = VideoReformatter()
    buf: np.ndarray | None = None
    out: FrameFile | None = None
    index: list[int] = []
    errors: list[int] = []
    ranges: list[tuple[int, int]] = []
    motion: list[float] = []
    thumb: np.ndarray | None = None

    def take(frames: Iterable[av.VideoFrame]) -> None:
        nonlocal buf, out, thumb
        for frame in frames:
            if frame.pts is None or not 0 <= frame.pts < len(packets):
                raise ConversionError(f"decoder returned a frame with pts {frame.pts!r}", path, code="decode_error")
            if ts_ns is not None and index and ts_ns[frame.pts] == ts_ns[index[-1]]:
                continue
            if image_size is None:
                rgb = scaler.reformat(frame, format="rgb24", interpolation=_SWS_FLAGS).to_ndarray()
            else:
                rgb = scaler.reformat(
                    frame, width=image_size[0], height=image_size[1], format="rgb24", interpolation=_SWS_FLAGS
                ).to_ndarray()
            if rgb_path is not None:
                if out is None:
                    out = FrameFile(rgb_path, rgb.shape, len(packets))
                out.append(rgb)
            else:
                if buf is None:
                    buf = np.empty((len(packets), *rgb.shape), dtype=np.uint8)
                buf[len(index)] = rgb
            ranges.append((int(rgb.min()), int(rgb.max())))
            change, thumb = frame_motion(rgb, thumb)
            if on_frame is not None:
                on_frame(rgb)
            motion.append(change)
            index.append(int(frame.pts))

    try:
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
    except BaseException:
        if out is not None:
            out.abort()
        raise
    if not index:
        raise ConversionError(
            f"no decodable camera frame in {len(packets)} packets (no IDR frame with SPS/PPS?)",
            path,
            code="undecodable",
        )
    idx = np.asarray(index, dtype=np.int64)
    prefix_crc32 = None
    if out is not None:
        out.close()
        frames = np.load(rgb_path, mmap_mode="r")
        prefix_crc32 = np.asarray(out.prefix_crc32, dtype=np.int64)
    else:
        frames = buf[: len(idx)]
    if np.any(np.diff(idx) <= 0):
        raise ConversionError("camera frames decoded out of capture order (B-frames?)", path, code="decode_error")
    return (frames, idx, errors, np.asarray(ranges, dtype=np.uint8).reshape(-1, 2), prefix_crc32,
            np.asarray(motion, dtype=np.float32))
