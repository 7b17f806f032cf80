"""Camera decoding: H.264 camera messages in, RGB frames resized in one swscale pass out.

Takes one episode's camera messages (``bytes``, capture order, each holding any number of access
units), their capture times, the order to decode them in and the image size (W, H pixels); gives
uint8 ``(K, H, W, 3)`` frames in presentation order, in memory or streamed to a scratch ``.npy``
file with plain writes (:class:`FrameFile`: nothing the size of the episode stays in the process),
the message and capture time of each frame, the messages the decoder rejected and each frame's
pixel range.
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
from dpflow_core.recordings.reader import starts_clean

#: swscale flags of the one-pass YUV->RGB conversion and resize: area averaging, with
#: full-resolution chroma interpolation and accurate rounding. Measured on sample
#: frames against the source resized with OpenCV INTER_AREA: mean error 2.5 levels,
#: versus 2.9 for decode-to-BGR + cv2.resize(INTER_AREA) (3.8 for plain SWS_AREA),
#: and about 1.3x faster than the OpenCV path (docs/benchmarks.md).
SWS_FLAGS = Interpolation.AREA | Interpolation.FULL_CHR_H_INT | Interpolation.ACCURATE_RND


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


def access_unit_times(ts_ns: np.ndarray, i: int, n: int, period_ns: float) -> list[int]:
    """Capture times (ns) of the ``n`` access units of camera message ``i``.

    A message carries one capture time; when it carries ``n > 1`` access units, the others are
    frames whose own messages are missing, so they fill the hole beside it: the longer of the
    intervals to the previous and the next message (capture order), at the spacing
    ``min(hole, n * period) / n`` from the message's time (after it when the hole follows, ending
    at it when the hole precedes). ``ts_ns``: (N,) int64 capture times, capture order;
    ``period_ns``: the stream's median message interval.
    """
    t = int(ts_ns[i])
    if n == 1:
        return [t]
    before = t - int(ts_ns[i - 1]) if i > 0 else None
    after = int(ts_ns[i + 1]) - t if i + 1 < len(ts_ns) else None
    forward = before is None or (after is not None and after >= before)
    hole = after if forward else before
    step = min(hole if hole is not None else n * period_ns, n * period_ns) / n
    if forward:
        return [t + int(round(k * step)) for k in range(n)]
    return [t - int(round((n - 1 - k) * step)) for k in range(n)]


def decode_camera(
    packets: Sequence[bytes],
    image_size: tuple[int, int] | None,
    codec: str,
    rgb_path: Path | None,
    path: Path,
    ts_ns: np.ndarray,
    on_frame: Callable[[np.ndarray], None] | None = None,
    decode_order: np.ndarray | None = None,
    max_width: int | None = None,
    damaged: list[dict] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Decode H.264 camera messages to RGB frames, as the standard allows them to be packed.

    Messages are fed to the decoder in decode order (``decode_order``: indices into ``packets``,
    e.g. :attr:`~dpflow_core.recordings.reader.EpisodeStreams.camera_decode_order`; None: capture
    order). Each message is split into its access units by the codec's own parser
    (``CodecContext.parse``, flushed after every message so each unit stays with its message): a
    message may carry any number of them, each its own frame, timed by :func:`access_unit_times`.
    Every unit gets ``pts`` = its position in the decode sequence, so each decoded frame says which
    unit (and message) it came from; units before the first IDR frame produce no frame.

    Frames leave the decoder in presentation order. With B-frames that differs from decode order;
    the frames are then placed by presentation: when the units' capture times, in the order the
    decoder presents them, increase, each frame keeps its unit's time (the messages carry each
    frame's capture time); when they do not (the messages were stamped in decode order), the
    k-th presented frame takes the k-th earliest of those times. A stream the decoder did not
    reorder whose capture times still go backwards is an error (``decode_error``).

    A unit the decoder rejects (``InvalidDataError``), or a frame it flags corrupt, damages the
    reference of every later unit in decode order until one that references nothing earlier
    (:func:`~dpflow_core.recordings.reader.starts_clean`: an IDR or all-intra unit): those frames
    decode without an error but show the damage (the concealed reference's blocks drift with the
    motion vectors), so they are dropped, never kept. Each damage appends to ``damaged`` (when a list
    is given) ``{"message", "until_message", "frames", "first_ns", "last_ns"}``: the message whose unit
    was rejected, the first clean one after it (None: none came), and the dropped frames' count and
    capture times (ns); a damage that drops no frame (units before the first IDR) is not listed.
    A message that repeats the one before it byte for byte and is not a key frame (a resend) is not
    decoded again, which would apply its predicted units twice: it is listed in ``damaged`` with
    ``"code": "duplicate_payload"`` and ``of_message``, and its time is left as a gap.

    Every unit is decoded even when ``ts_ns`` repeats a capture time (a later frame may reference
    it); a frame whose capture time equals the previous kept frame's is then dropped, so the kept
    frames are bit-identical to a full decode. Frames are converted to RGB and resized by one
    ``VideoReformatter`` (one swscale context, :data:`SWS_FLAGS`) for the whole stream:
    bit-identical to ``VideoFrame.reformat`` per frame.

    With ``rgb_path`` the frames stream to that ``.npy`` file as they are decoded
    (:class:`FrameFile`) and are returned as a read-only memory map of it: nothing the
    size of the episode is held in this process. ``on_frame`` receives each kept (H, W, 3) RGB frame,
    in presentation order, while it is in memory (the image motion of :mod:`dpflow_core.offsets`).

    Args:
        packets: (N,) camera message payloads (H.264 Annex-B), capture order.
        image_size: (W, H) pixels of every frame; None keeps the camera's size (frames wider than
            ``max_width`` pixels, when given, are scaled to that width keeping their aspect: a preview's).
        codec: PyAV's decoder name (``"h264"``; ``"hevc"`` for a preview).
        ts_ns: (N,) int64 capture time of each message, ns, non-decreasing.

    Returns:
        frames (K, H, W, 3) uint8 (a read-only memory map when ``rgb_path`` is given; rows in
        presentation order), message index (K,) int64 of each frame (a message with several units
        appears once per frame), the indices of messages a unit of which the decoder rejected,
        (K, 2) uint8 per-frame (min, max) pixel values, with ``rgb_path`` the (K + 1,) int64 CRC-32
        of the file's first k rows (:attr:`FrameFile.prefix_crc32`), else None; (K,) float32 image
        change of each frame against the one before (:func:`~dpflow_core.recordings.plausibility.frame_motion`,
        grey levels; 0 for the first); and (K,) int64 capture time of each frame, ns, increasing.
    """
    ts_ns = np.asarray(ts_ns, dtype=np.int64)
    order = np.arange(len(packets)) if decode_order is None else np.asarray(decode_order, dtype=np.int64)
    steps = np.diff(np.unique(ts_ns))
    period_ns = float(np.median(steps)) if len(steps) else 1e9 / 30
    sink = _FrameSink(len(packets), image_size, max_width, rgb_path, on_frame)
    sink.damaged = damaged if damaged is not None else []
    try:
        errors = _feed(packets, order, ts_ns, period_ns, codec, sink, path)
    except BaseException:
        sink.abort()
        raise
    if not sink.index:
        sink.abort()
        raise ConversionError(
            f"no decodable camera frame in {len(packets)} packets (no IDR frame with SPS/PPS?)",
            path,
            code="undecodable",
        )
    sink.damaged[:] = [d for d in sink.damaged if d["frames"]]
    frames, prefix_crc32 = sink.finish()
    times = _presentation_times(np.asarray(sink.frame_ns, dtype=np.int64), sink.serial, path)
    return (frames, np.asarray(sink.index, dtype=np.int64), sorted(errors),
            np.asarray(sink.ranges, dtype=np.uint8).reshape(-1, 2), prefix_crc32,
            np.asarray(sink.motion, dtype=np.float32), times)


def damage_findings(damaged: list[dict], origin_ns: int) -> list[dict]:
    """:func:`decode_camera`'s ``damaged`` entries as findings: ``{"code": "damaged_reference" or
    "duplicate_payload", "reason",
    "from_s", "to_s", "frames", "message", "until_message", "action": "dropped"}``, times in s from
    ``origin_ns`` (the episode's start)."""
    out = []
    for d in damaged:
        a, b = (d["first_ns"] - origin_ns) / 1e9, (d["last_ns"] - origin_ns) / 1e9
        if d.get("code") == "duplicate_payload":
            out.append({"code": "duplicate_payload", "from_s": round(a, 4), "to_s": round(b, 4), "frames": 1,
                        "message": d["message"], "until_message": None, "action": "dropped",
                        "reason": (f"camera message {d['message']} at {a:.3f} s repeats message {d['of_message']}'s "
                                   "payload byte for byte (a resend): decoding it again would corrupt every frame until "
                                   "the next key frame, so it was left out and its time is a gap")})
            continue
        until = (f"until the next clean frame (message {d['until_message']})" if d["until_message"] is not None
                 else "to the end (no clean frame came)")
        out.append({"code": "damaged_reference", "from_s": round(a, 4), "to_s": round(b, 4), "frames": d["frames"],
                    "message": d["message"], "until_message": d["until_message"], "action": "dropped",
                    "reason": (f"camera message {d['message']} failed to decode: the {d['frames']} frames decoded from "
                               f"its damaged reference, {a:.3f}-{b:.3f} s, {until}, were dropped")})
    return out


class _FrameSink:
    """Where :func:`decode_camera`'s decoded frames go: converted and resized by one scaler, kept in
    memory or streamed to a :class:`FrameFile`, with each frame's unit, message, time, range and motion."""

    def __init__(self, capacity: int, image_size: tuple[int, int] | None, max_width: int | None,
                 rgb_path: Path | None, on_frame: Callable[[np.ndarray], None] | None):
        self.capacity, self.image_size, self.max_width = capacity, image_size, max_width
        self.rgb_path, self.on_frame = rgb_path, on_frame
        # One scaler for the whole stream: ``VideoFrame.reformat`` gives every frame a new swscale
        # context, whose set-up (the area filter's coefficients) costs about a third of the scaling
        # itself at 640x480 -> 224x224; the pixels are the same either way (docs/benchmarks.md).
        self.scaler = VideoReformatter()
        self.buf: np.ndarray | None = None
        self.out: FrameFile | None = None
        self.unit_msg: list[int] = []
        self.unit_ns: list[int] = []
        self.index: list[int] = []
        self.serial: list[int] = []
        self.frame_ns: list[int] = []
        self.ranges: list[tuple[int, int]] = []
        self.motion: list[float] = []
        self.thumb: np.ndarray | None = None
        #: per unit: the damage (an entry of ``damaged``) its reference carries, or None
        self.unit_damage: list[dict | None] = []
        self.damage: dict | None = None
        self.damaged: list[dict] = []

    def start_damage(self, message: int) -> None:
        """A unit of ``message`` was rejected: later units carry the damage until a clean one."""
        if self.damage is None:
            self.damage = {"message": message, "until_message": None, "frames": 0, "first_ns": None, "last_ns": None}
            self.damaged.append(self.damage)

    def end_damage(self, message: int) -> None:
        """A clean unit of ``message``: frames after it reference nothing damaged."""
        if self.damage is not None:
            self.damage["until_message"] = message
            self.damage = None

    def _rgb(self, frame: av.VideoFrame) -> np.ndarray:
        if self.image_size is None and self.max_width is not None and frame.width > self.max_width:
            height = max(1, round(frame.height * self.max_width / frame.width))
            return self.scaler.reformat(frame, width=self.max_width, height=height, format="rgb24",
                                        interpolation=SWS_FLAGS).to_ndarray()
        if self.image_size is None:
            return self.scaler.reformat(frame, format="rgb24", interpolation=SWS_FLAGS).to_ndarray()
        return self.scaler.reformat(frame, width=self.image_size[0], height=self.image_size[1], format="rgb24",
                                    interpolation=SWS_FLAGS).to_ndarray()

    def take(self, frames: Iterable[av.VideoFrame], path: Path) -> None:
        for frame in frames:
            if frame.pts is None or not 0 <= frame.pts < len(self.unit_msg):
                raise ConversionError(f"decoder returned a frame with pts {frame.pts!r}", path, code="decode_error")
            t = self.unit_ns[frame.pts]
            if self.frame_ns and t == self.frame_ns[-1]:
                continue
            if frame.is_corrupt and self.unit_damage[frame.pts] is None:
                self.start_damage(self.unit_msg[frame.pts])
                self.unit_damage[frame.pts] = self.damage
            hit = self.unit_damage[frame.pts]
            if hit is not None:
                hit["frames"] += 1
                hit["first_ns"] = t if hit["first_ns"] is None else min(hit["first_ns"], t)
                hit["last_ns"] = t if hit["last_ns"] is None else max(hit["last_ns"], t)
                continue
            rgb = self._rgb(frame)
            if self.rgb_path is not None:
                if self.out is None:
                    self.out = FrameFile(self.rgb_path, rgb.shape, self.capacity)
                self.out.append(rgb)
            else:
                if self.buf is None:
                    self.buf = np.empty((self.capacity, *rgb.shape), dtype=np.uint8)
                elif len(self.index) == len(self.buf):
                    self.buf = np.concatenate([self.buf, np.empty_like(self.buf[: max(1, len(self.buf) // 2)])])
                self.buf[len(self.index)] = rgb
            self.ranges.append((int(rgb.min()), int(rgb.max())))
            change, self.thumb = frame_motion(rgb, self.thumb)
            if self.on_frame is not None:
                self.on_frame(rgb)
            self.motion.append(change)
            self.index.append(self.unit_msg[frame.pts])
            self.serial.append(int(frame.pts))
            self.frame_ns.append(t)

    def abort(self) -> None:
        if self.out is not None:
            self.out.abort()

    def finish(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The frames (a read-only memory map of the file when streamed) and the file's prefix CRC-32s."""
        if self.out is None:
            return self.buf[: len(self.index)], None
        self.out.close()
        return np.load(self.rgb_path, mmap_mode="r"), np.asarray(self.out.prefix_crc32, dtype=np.int64)


def _feed(packets: Sequence[bytes], order: np.ndarray, ts_ns: np.ndarray, period_ns: float, codec: str,
          sink: _FrameSink, path: Path) -> set[int]:
    """Split each message (in ``order``) into access units with the codec's parser, decode them into
    ``sink``; returns the messages a unit of which the decoder rejected."""
    parser = av.CodecContext.create(codec, "r")
    ctx = av.CodecContext.create(codec, "r")
    # Parallelism comes from worker processes; decoder threads did not help.
    ctx.thread_count = 1
    errors: set[int] = set()
    previous: tuple[int, bytes] | None = None
    for i in order:
        i = int(i)
        raw = bytes(packets[i])
        if previous is not None and raw == previous[1] and not starts_clean(raw):
            # a message repeating the one before byte for byte (a transport resend): decoded again, its
            # predicted units would be applied twice and every frame until the next key frame drift
            sink.damaged.append({"code": "duplicate_payload", "message": i, "of_message": previous[0], "frames": 1,
                                 "until_message": None, "first_ns": int(ts_ns[i]), "last_ns": int(ts_ns[i])})
            continue
        previous = (i, raw)
        units = [bytes(u) for u in parser.parse(raw)]
        units += [bytes(u) for u in parser.parse(None)]
        # Bytes the parser finds no unit in still go to the decoder (it names them rejected).
        units = units or [bytes(packets[i])]
        for t in access_unit_times(ts_ns, i, len(units), period_ns):
            sink.unit_msg.append(i)
            sink.unit_ns.append(t)
        for k, data in enumerate(units):
            packet = av.Packet(data)
            serial = packet.pts = packet.dts = len(sink.unit_msg) - len(units) + k
            if starts_clean(data):
                sink.end_damage(i)
            sink.unit_damage.append(sink.damage)
            try:
                sink.take(ctx.decode(packet), path)
            except av.error.InvalidDataError:
                errors.add(i)
                sink.start_damage(i)
                sink.unit_damage[serial] = sink.damage
    try:
        sink.take(ctx.decode(None), path)
    except av.error.InvalidDataError:
        pass
    return errors


def _presentation_times(times: np.ndarray, serial: list[int], path: Path) -> np.ndarray:
    """Each presented frame's capture time (see :func:`decode_camera`: sorted when the decoder reordered
    B-frames and the messages were stamped in decode order)."""
    if np.any(np.diff(times) <= 0):
        if not np.any(np.diff(serial) < 0):
            raise ConversionError(
                "camera frames decode in an order their capture times contradict, and the stream has no "
                "B-frames to explain it (messages out of decode order?)", path, code="decode_error")
        times = np.sort(times)
        if np.any(np.diff(times) <= 0):
            raise ConversionError("camera frames with B-frames repeat a capture time after reordering",
                                  path, code="decode_error")
    return times
