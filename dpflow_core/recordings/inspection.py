"""Inspection: validate one recording and report its figures and faults as data.

Takes a ``.mcap`` path and a :class:`~dpflow_core.recordings.topics.TopicMap`; gives a
:class:`~dpflow_core.recordings.recording_report.RecordingReport` (per-topic counts, rates in Hz, start and end in s, the first decodable
H.264 frame, and :class:`Problem` entries with codes such as ``truncated_mcap``), which pairing puts
in the manifest. Faults are data here, never exceptions.

This module is over 500 lines because :func:`inspect_recording` is one streaming pass whose checks
(one function per stage: the pass, counts, topics, streams, camera, overlap) share the pass's state
(:class:`_Pass`); split across modules, they would pass that private state between them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError
from mcap.exceptions import EndOfFile, InvalidMagic
from mcap.records import Channel, ChunkIndex, Footer, Message, MessageIndex, Schema, Statistics
from mcap.stream_reader import StreamReader
from mcap_protobuf.decoder import DecoderFactory

from dpflow_core.errors import RecordingError
from dpflow_core.files import HashingReader
from dpflow_core.recordings.plausibility import PlausibilityOptions, check_clock
from dpflow_core.recordings.recording_report import Problem, RecordingReport  # noqa: F401  (re-exported)
from dpflow_core.recordings.stream_checks import (calibration_problems, frozen_clock, frozen_clock_reason, other_cameras,
                                                 timestamp_units)
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


# ---------------------------------------------------------------------------
# Validation of one recording, reported as data
# ---------------------------------------------------------------------------

#: A stream starting (or ending) more than this many seconds after (before) the
#: other required streams is reported for trimming.
LATE_START_WARN_S = 0.1
#: A measured rate further than this fraction from the header's ``expect_hz`` is reported.
RATE_TOLERANCE = 0.1
#: At most this many leading camera packets are kept to find the first decodable frame.
H264_PROBE_PACKETS = 300
#: Error codes after which the rest of the file could not be read.
_STRUCTURAL = frozenset({"empty_file", "not_mcap", "crlf_converted", "truncated_mcap", "missing_closing_magic", "corrupt_mcap"})


class _TopicStats:
    """Capture and log times of one topic, gathered during the streaming pass."""

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.log_times: list[int] = []
        self.expect_hz: float | None = None
        #: samples (pose: while ``pose_valid``) holding a NaN or inf: (count, first message index, field)
        self.nonfinite: tuple[int, int, str] | None = None

    def note_nonfinite(self, index: int, values: dict[str, float]) -> None:
        bad = next((name for name, v in values.items() if not math.isfinite(v)), None)
        if bad is not None:
            n = self.nonfinite[0] if self.nonfinite else 0
            self.nonfinite = (n + 1, *(self.nonfinite[1:] if self.nonfinite else (index, f"{bad} = {values[bad]}")))


def _first_decodable(packets: list[tuple[int, bytes]], sizes: list | None = None) -> int | None:
    """Index of the first packet (capture order) for which libavcodec outputs a frame (its ``(width,
    height)`` appended to ``sizes`` when given).

    ``packets`` is [(capture ns, Annex-B access unit)] sorted by capture time.
    Packets before the first IDR access unit with SPS/PPS yield no frame
    (formats.md, known traps); each packet carries its index as pts, so a
    decoder delay does not shift the answer.
    """
    import av  # local: validation without a camera probe needs no libavcodec

    ctx = av.CodecContext.create("h264", "r")
    ctx.thread_count = 1
    for i, (_ts, data) in enumerate(packets):
        pkt = av.Packet(data)
        pkt.pts = i
        try:
            frames = ctx.decode(pkt)
        except av.FFmpegError:
            continue
        if frames:
            if sizes is not None:
                sizes.append((frames[0].width, frames[0].height))
            return int(frames[0].pts) if frames[0].pts is not None else i
    try:
        frames = ctx.decode(None)
    except av.FFmpegError:
        frames = []
    if sizes is not None and frames:
        sizes.append((frames[0].width, frames[0].height))
    return int(frames[0].pts) if frames and frames[0].pts is not None else None


#: The MCAP magic ``89 'MCAP0' 0D 0A`` after a text-mode copy turned CRLF into LF.
CRLF_CONVERTED_MAGIC = b"\x89MCAP0\n"
#: Streams whose first capture times differ by more than this (ns: one day) run on different clocks.
CLOCK_DOMAIN_NS = 86_400 * 10**9


def clock_domain_note(starts_ns: dict[str, int]) -> str:
    """``"clock domains differ: camera 1.26e9 ns, pose 1.75e18 ns"`` when the streams' first
    capture times are more than a day apart (e.g. one counts from boot, another from the
    Unix epoch), else ``""``. ``starts_ns``: stream name -> first capture time, ns."""
    if len(starts_ns) < 2 or max(starts_ns.values()) - min(starts_ns.values()) <= CLOCK_DOMAIN_NS:
        return ""
    def short(ns: int) -> str:
        return f"{float(ns):.3g}".replace("e+0", "e").replace("e+", "e")

    return "clock domains differ: " + ", ".join(f"{name} {short(ns)} ns" for name, ns in starts_ns.items())


_ARM = re.compile(r"^(/robot\d+)/")


def _other_arms(topic_names, topics: TopicMap) -> tuple[str, dict[str, list[str]]] | None:
    """``(own arm prefix, {other arm prefix: [topics]})`` when the file carries ``/robotN/...``
    topics of an arm other than the one ``topics.camera`` belongs to; None otherwise."""
    own = _ARM.match(topics.camera)
    if own is None:
        return None
    others: dict[str, list[str]] = {}
    for name in sorted(topic_names):
        m = _ARM.match(name)
        if m and m.group(1) != own.group(1):
            others.setdefault(m.group(1), []).append(name)
    return (own.group(1), others) if others else None


def inspect_recording(
    path: str | Path,
    topics: TopicMap = DAS_DEFAULT,
    required: tuple[str, ...] | None = None,
    probe_video: bool = True,
) -> RecordingReport:
    """Validate one MCAP recording in a single streaming pass and report the figures.

    The whole file is read record by record (``mcap.stream_reader.StreamReader``
    with CRC validation), so a file without summary or message index is still read
    completely; the counts read are compared with the Statistics record when
    present (a seeking read of an index-less file returns zero messages without
    error, formats.md section 1). Messages of the measured topics (camera, pose,
    gripper, IMU, camera_info and extra cameras of ``topics``) are decoded with
    the protobuf schemas embedded in the file to get ``header.timestamp``. H.264
    is decoded only until the first frame comes out (full decoding is the
    conversion's job).

    Args:
        path: the ``.mcap`` file.
        topics: topic names and accepted schema names.
        required: topics that must be present with messages; default
            ``topics.required()`` (camera, pose, gripper: a ``<STEM>_vio.mcap``).
            A raw ``<STEM>.mcap`` has no pose: pass ``(topics.camera, topics.gripper)``.
        probe_video: find the first decodable camera frame (leading undecodable packets).

    Returns:
        The report. Bad content never raises: it is listed in ``errors`` with a
        code (``empty_file``, ``not_mcap``, ``truncated_mcap``,
        ``missing_closing_magic``, ``corrupt_mcap``, ``unknown_encoding``,
        ``missing_topics``, ``unexpected_schema``, ``no_messages``,
        ``count_mismatch``, ``undecodable_message``, ``no_header``,
        ``no_decodable_frame``, ``no_overlap``, ``clock_domains_differ`` (first capture times
        more than a day apart), ``crlf_converted`` (magic damaged by a text-mode copy),
        ``clock_step`` / ``clock_reversal`` (a stream's capture clock jumped against its arrival
        times: :func:`~dpflow_core.recordings.plausibility.check_clock`),
        ``unsupported_multi_arm``: ``/robotN/...``
        topics of a second arm beside the converted one) and a reason naming the byte
        offset, topic or count; tolerated faults are in ``warnings``
        (``no_index``, ``log_time_inversions``, ``duplicate_timestamps``,
        ``late_start``, ``early_end``, ``leading_undecodable``, ``pose_invalid``,
        ``rate_mismatch``, ``unknown_encoding`` and ``unexpected_schema`` on an
        optional topic).

    Raises:
        RecordingError: ``path`` is not a file (code ``missing_file``).
    """
    path = Path(path)
    if not path.is_file():
        raise RecordingError("file not found", path, code="missing_file")
    size = path.stat().st_size
    required = tuple(topics.required()) if required is None else tuple(required)
    report = RecordingReport(path=path, size_bytes=size, required=required)
    if size == 0:
        report.errors.append(Problem("empty_file", f"{path.name}: empty file (0 bytes)"))
        return report
    measured = [t for t in (topics.camera, topics.pose, topics.gripper, topics.imu, topics.camera_info, *topics.extra_cameras) if t]
    state = _Pass(stats={t: _TopicStats() for t in measured})
    _stream_pass(path, topics, required, probe_video, report, state)
    if not _check_counts(report, state):
        return report
    _check_topics(report, state, topics)
    _check_streams(report, state)
    camera_start = _camera_figures(report, state, topics, probe_video)
    for (w, h, k), index in state.calibrations.items():  # camera_info is not trained on: a warning
        if problems := calibration_problems(w, h, k, state.frame_size[0] if state.frame_size else None):
            report.warnings.append(Problem("camera_info_implausible", (
                f"{path.name}: {topics.camera_info} message {index}: {'; '.join(problems)}: no camera has this "
                "calibration (not trained on; fix the device's calibration before using it)")))
            break
    _check_overlap(report, topics, camera_start)
    return report


@dataclass
class _Pass:
    """What the streaming pass of :func:`inspect_recording` gathers for the checks after it."""

    stats: dict[str, _TopicStats]
    schemas: dict[int, Schema] = field(default_factory=dict)
    channels: dict[int, Channel] = field(default_factory=dict)
    decoders: dict[int, object] = field(default_factory=dict)
    undecodable: dict[str, int] = field(default_factory=dict)
    no_header: set[str] = field(default_factory=set)
    per_channel: dict[int, int] = field(default_factory=dict)
    statistics: Statistics | None = None
    footer: Footer | None = None
    pose_invalid: int = 0
    camera_heap: list[tuple[int, int, bytes]] = field(default_factory=list)  # max-heap on capture time: (-ts, -seq, data)
    camera_digests: list[tuple[int, bytes]] = field(default_factory=list)  # (capture ns, SHA-256 of the payload)
    calibrations: dict[tuple, int] = field(default_factory=dict)  # camera_info (width, height, K) -> first message
    frame_size: list[tuple[int, int]] = field(default_factory=list)  # the first decoded frame's (width, height)
    factory: DecoderFactory = field(default_factory=DecoderFactory)  # one per file: it caches classes by schema id


def _stream_pass(path: Path, topics: TopicMap, required: tuple[str, ...], probe_video: bool,
                 report: RecordingReport, state: _Pass) -> None:
    """Read every record of ``path`` once (CRCs checked), filling ``state``; a structural fault becomes
    an error of ``report``; the file's SHA-256 is taken from the same bytes."""
    size = report.size_bytes
    with HashingReader(path) as f:
        try:
            for record in StreamReader(f, validate_crcs=True).records:
                if isinstance(record, Message):
                    _on_message(record, state, report, topics, probe_video)
                elif isinstance(record, Schema):
                    state.schemas[record.id] = record
                elif isinstance(record, Channel):
                    _on_channel(record, state, report, required)
                elif isinstance(record, MessageIndex):
                    report.has_message_index = True
                elif isinstance(record, ChunkIndex):
                    report.has_chunk_index = True
                    if record.message_index_offsets:
                        report.has_message_index = True
                elif isinstance(record, Statistics):
                    state.statistics = record
                elif isinstance(record, Footer):
                    state.footer = record
        except InvalidMagic as exc:
            offset = 0 if f.tell() <= 8 else f.tell()
            kind = "opening" if offset == 0 else "closing"
            with open(path, "rb") as head:
                first = head.read(8)
            if offset == 0 and first.startswith(CRLF_CONVERTED_MAGIC):
                report.errors.append(Problem(
                    "crlf_converted",
                    f"{path.name}: not an MCAP file as written: the opening magic ends in 0A where MCAP has 0D 0A; "
                    "bytes look CRLF->LF converted; copy the file in binary mode (no line-ending conversion)",
                ))
            else:
                report.errors.append(Problem(
                    "not_mcap" if offset == 0 else "corrupt_mcap",
                    f"{path.name}: not an MCAP file: bad {kind} magic at byte {offset} ({exc})",
                ))
        except EndOfFile:
            n_read = sum(state.per_channel.values())
            if state.footer is not None:
                report.errors.append(Problem(
                    "missing_closing_magic",
                    f"{path.name}: missing closing magic: the file ends at byte {size} right after the "
                    "footer (written or copied incompletely)",
                ))
            else:
                report.errors.append(Problem(
                    "truncated_mcap",
                    f"{path.name}: truncated MCAP: the file ends at byte {size} in the middle of a record, "
                    f"before the footer ({n_read} messages readable before the cut)",
                ))
        except Exception as exc:  # McapError, CRC ValueError, and the decompressors' own types (zstd, lz4)
            report.errors.append(Problem(
                "corrupt_mcap",
                f"{path.name}: corrupt MCAP near byte {f.tell()} of {size}: {type(exc).__name__}: {exc}",
            ))
        # The same bytes the parser read, plus any it left: the file is read once for both.
        report.sha256 = f.sha256()


def _on_message(record: Message, state: _Pass, report: RecordingReport, topics: TopicMap, probe_video: bool) -> None:
    """One message of the streaming pass: counted, and for a measured topic decoded for its capture time."""
    state.per_channel[record.channel_id] = state.per_channel.get(record.channel_id, 0) + 1
    channel = state.channels.get(record.channel_id)
    if channel is None or channel.topic not in state.stats:
        return
    decoder = state.decoders.get(record.channel_id)
    if decoder is None:
        return
    topic = channel.topic
    try:
        decoded = decoder(record.data)
    except (DecodeError, ValueError):
        state.undecodable[topic] = state.undecodable.get(topic, 0) + 1
        return
    header = getattr(decoded, "header", None)
    if header is None:
        state.no_header.add(topic)
        return
    st = state.stats[topic]
    ts = int(header.timestamp)
    if st.expect_hz is None:
        st.expect_hz = float(getattr(header, "expect_hz", 0.0) or 0.0)
    st.ts.append(ts)
    st.log_times.append(record.log_time)
    if topic == topics.camera:
        if not report.camera_format:
            report.camera_format = str(getattr(decoded, "format", ""))
        state.camera_digests.append((ts, hashlib.sha256(decoded.data).digest()))
        if probe_video:
            item = (-ts, -len(st.ts), bytes(decoded.data))
            if len(state.camera_heap) < H264_PROBE_PACKETS:
                heapq.heappush(state.camera_heap, item)
            elif item > state.camera_heap[0]:
                heapq.heapreplace(state.camera_heap, item)
    elif topic == topics.pose:
        if not getattr(decoded, "pose_valid", True):
            state.pose_invalid += 1
        elif hasattr(decoded, "pose"):
            p, q = decoded.pose.position, decoded.pose.orientation
            st.note_nonfinite(len(st.ts) - 1, {"position.x": p.x, "position.y": p.y, "position.z": p.z,
                                               "orientation.x": q.x, "orientation.y": q.y,
                                               "orientation.z": q.z, "orientation.w": q.w})
    elif topic == topics.gripper and hasattr(decoded, "value"):
        st.note_nonfinite(len(st.ts) - 1, {"value": decoded.value})
    elif topic == topics.camera_info and hasattr(decoded, "K") and len(state.calibrations) < 5:
        state.calibrations.setdefault((int(decoded.width), int(decoded.height), tuple(decoded.K)), len(st.ts) - 1)


def _on_channel(record: Channel, state: _Pass, report: RecordingReport, required: tuple[str, ...]) -> None:
    """A channel record: its topic's schema and encoding, and a decoder for a measured topic."""
    if record.id in state.channels:  # repeated in the summary section
        return
    state.channels[record.id] = record
    schema = state.schemas.get(record.schema_id)
    report.schemas[record.topic] = schema.name if schema else ""
    report.encodings[record.topic] = record.message_encoding
    if record.topic in state.stats:
        decoder = state.factory.decoder_for(record.message_encoding, schema)
        if decoder is None:
            code_reason = (
                f"{report.path.name}: topic {record.topic} uses message encoding "
                f"{record.message_encoding!r} with schema encoding "
                f"{schema.encoding if schema else 'none'!r}; only protobuf can be decoded"
            )
            target = report.errors if record.topic in required else report.warnings
            target.append(Problem("unknown_encoding", code_reason))
        else:
            state.decoders[record.id] = decoder


def _check_counts(report: RecordingReport, state: _Pass) -> bool:
    """Messages per topic, against the Statistics record when there is one; False when a structural
    fault left the rest of the file unread (the later checks are then skipped)."""
    path = report.path
    report.has_summary = state.footer is not None and state.footer.summary_start != 0
    report.has_statistics = state.statistics is not None
    topic_of = {cid: ch.topic for cid, ch in state.channels.items()}
    for cid, n in state.per_channel.items():
        topic = topic_of.get(cid, f"<channel {cid}>")
        report.message_counts[topic] = report.message_counts.get(topic, 0) + n
    for topic in state.channels.values():
        report.message_counts.setdefault(topic.topic, 0)
    read_ok = not any(p.code in _STRUCTURAL for p in report.errors)

    if state.statistics is not None:
        summary_counts: dict[str, int] = {}
        for cid, n in state.statistics.channel_message_counts.items():
            topic = topic_of.get(cid, f"<channel {cid}>")
            summary_counts[topic] = summary_counts.get(topic, 0) + n
        for channel in state.channels.values():  # channels without messages are left out of the record
            summary_counts.setdefault(channel.topic, 0)
        report.summary_counts = summary_counts
        if read_ok:
            for topic in sorted(set(summary_counts) | set(report.message_counts)):
                got, want = report.message_counts.get(topic, 0), summary_counts.get(topic, 0)
                if got != want:
                    report.errors.append(Problem(
                        "count_mismatch",
                        f"{path.name}: topic {topic}: read {got} messages, summary statistics say {want}",
                    ))
    if read_ok and not report.indexed:
        missing_parts = [name for name, present in (
            ("summary", report.has_summary), ("chunk index", report.has_chunk_index),
            ("message index", report.has_message_index), ("statistics", report.has_statistics)) if not present]
        report.warnings.append(Problem(
            "no_index",
            f"{path.name}: no {' and no '.join(missing_parts)}: read in a streaming pass"
            + ("" if report.has_statistics else "; message counts could not be checked against statistics"),
        ))
    return read_ok


def _check_topics(report: RecordingReport, state: _Pass, topics: TopicMap) -> None:
    """The topics present: one arm, the required ones with messages, the expected schemas, decodable headers."""
    path, required = report.path, report.required
    arms = _other_arms(report.schemas, topics)
    if arms:
        own, others = arms
        listed = ", ".join(f"{prefix} ({len(ts)} topics, e.g. {ts[0]})" for prefix, ts in sorted(others.items()))
        report.errors.append(Problem(
            "unsupported_multi_arm",
            f"{path.name}: topics of more than one arm: {own} (converted) and {listed}; only single-arm "
            "recordings are converted and an arm is never dropped silently: record or export each arm separately",
        ))
    if extra := other_cameras(report.schemas, topics.camera):
        report.warnings.append(Problem("camera_not_converted", (
            f"{path.name}: camera topic{'s' if len(extra) > 1 else ''} "
            f"{', '.join(f'{t} ({report.message_counts.get(t, 0)} messages)' for t in extra)} not converted: only "
            f"{topics.camera} becomes the dataset's camera0_rgb")))
    missing = [t for t in required if t not in report.schemas]
    if missing:
        report.errors.append(Problem(
            "missing_topics", f"{path.name}: not a Matrix Studio recording: missing topics {', '.join(missing)}"
        ))
    accepted_schemas = {
        topics.camera: topics.camera_schemas,
        topics.pose: topics.pose_schemas,
        topics.gripper: topics.gripper_schemas,
        topics.imu: topics.imu_schemas,
    }
    for topic, names in accepted_schemas.items():
        name = report.schemas.get(topic)
        if name is not None and name not in names and report.encodings.get(topic) == "protobuf":
            # Optional topics (e.g. the IMU, whose schema name formats.md does not know) only warn.
            target = report.errors if topic in required else report.warnings
            target.append(Problem(
                "unexpected_schema",
                f"{path.name}: topic {topic} has schema {name!r}, expected one of {list(names)}",
            ))
    for topic, n in state.undecodable.items():
        target = report.errors if topic in required else report.warnings
        target.append(Problem("undecodable_message", f"{path.name}: {n} {topic} messages fail to decode as protobuf"))
    for topic in sorted(state.no_header):
        target = report.errors if topic in required else report.warnings
        target.append(Problem("no_header", f"{path.name}: topic {topic} messages have no device header (header.timestamp)"))
    for topic in required:
        if topic in report.schemas and report.message_counts.get(topic, 0) == 0:
            report.errors.append(Problem("no_messages", f"{path.name}: required topic {topic} has no messages"))


def _check_streams(report: RecordingReport, state: _Pass) -> None:
    """Each measured stream's times: first and last, rate, clock steps, log-time order, repeated stamps."""
    path = report.path
    t0 = min((min(st.ts) for t, st in state.stats.items() if st.ts and t in report.required), default=None)
    off_unit = _check_units(report, state)
    for topic, st in state.stats.items():
        if not st.ts:
            continue
        t = np.asarray(st.ts, dtype=np.int64)
        lt = np.asarray(st.log_times, dtype=np.int64)
        target = report.errors if topic in report.required else report.warnings
        if st.nonfinite is not None:
            n_bad, k, value = st.nonfinite
            target.append(Problem("not_finite", (
                f"{path.name}: {topic} {value} at {(st.ts[k] - (t0 or st.ts[0])) / 1e9:.3f} s (message {k}"
                f"{f', and {n_bad - 1} more' if n_bad > 1 else ''} of {len(st.ts)}): a NaN/inf sample is no "
                "measurement and cannot be interpolated across")))
        frozen = frozen_clock(t, lt)
        if frozen is not None:
            target.append(Problem("clock_frozen", frozen_clock_reason(path.name, topic, frozen, len(t), t0 or int(t.min()))))
        report.log_time_inversions[topic] = int(np.count_nonzero(np.diff(lt) < 0))
        uniq = np.unique(t)
        report.duplicate_timestamps[topic] = int(len(t) - len(uniq))
        report.first_ts_ns[topic], report.last_ts_ns[topic] = int(uniq[0]), int(uniq[-1])
        span_s = (int(uniq[-1]) - int(uniq[0])) / 1e9
        report.rates_hz[topic] = (len(uniq) - 1) / span_s if span_s > 0 else 0.0
        steps = [] if topic in off_unit or frozen else check_clock(t, lt, int(uniq[0]), topic)
        back = None if steps or topic in off_unit or frozen else file_order_reversal(t, lt)
        if back is not None:
            k, size_s, device = back
            target.append(Problem("clock_reversal", (
                f"{path.name}: {topic} capture clock ran backwards by {size_s:.3f} s at "
                f"{(int(t[k - 1]) - (t0 or int(uniq[0]))) / 1e9:.3f} s (message {k}, file order"
                f"{'; arrival times went back with it: the device clock itself' if device else ''}): its samples "
                f"after that overlap {size_s:.3f} s of earlier ones and would interleave with them")))
        for f in steps:
            what = "stepped forward" if f.code == "clock_step" else "ran backwards"
            (report.errors if f.policy == "reject" else report.warnings).append(Problem(
                f.code, f"{path.name}: {topic} capture clock {what} by {abs(f.value):.3f} s at {f.at_s:.3f} s "
                        f"(message {f.detail['message_index']}; capture minus arrival time changed by more than "
                        f"{f.limit:g} s): the stream cannot be aligned with the others after it"))
        sampling_hz = 1e9 / float(np.median(np.diff(uniq))) if len(uniq) > 1 else 0.0
        if steps:
            # The span holds the step: a rate measured over it is no rate, so none is reported.
            report.rates_hz[topic] = sampling_hz
        if st.expect_hz:
            report.expected_hz[topic] = st.expect_hz
            # the sampling rate (the median interval), not messages over the span: a stretch cut out of the
            # recording (a curated trim) or a dropped frame is a gap, reported as one, not another rate
            if not steps and topic not in off_unit and sampling_hz and abs(sampling_hz / st.expect_hz - 1) > RATE_TOLERANCE:
                report.warnings.append(Problem(
                    "rate_mismatch",
                    f"{path.name}: {topic} sampled at {sampling_hz:.2f} Hz (median interval), header expects "
                    f"{st.expect_hz:g} Hz",
                ))
        if report.log_time_inversions[topic]:
            report.warnings.append(Problem(
                "log_time_inversions",
                f"{path.name}: {report.log_time_inversions[topic]} {topic} messages out of log-time order; "
                "sorted by capture time",
            ))
        if report.duplicate_timestamps[topic]:
            report.warnings.append(Problem(
                "duplicate_timestamps",
                f"{path.name}: {report.duplicate_timestamps[topic]} {topic} messages repeat a capture time; "
                "later duplicates dropped",
            ))


def _check_units(report: RecordingReport, state: _Pass) -> set[str]:
    """Streams whose capture stamps run a power of 1000 too slow or fast against the other streams
    (:func:`~dpflow_core.recordings.stream_checks.timestamp_units`): ``timestamp_units``, an error on a
    required topic, a warning on another; returns those topics."""
    off = timestamp_units({t: (st.ts, st.log_times) for t, st in state.stats.items()}, report.path.name)
    for topic, reason in off.items():
        (report.errors if topic in report.required else report.warnings).append(Problem("timestamp_units", reason))
    return set(off)


def file_order_reversal(ts_ns: np.ndarray, log_ns: np.ndarray, limit_s: float | None = None,
                        window: int = 9) -> tuple[int, float, bool] | None:
    """A stream's capture clock that went back in file (arrival) order, whatever its log times did.

    :func:`~dpflow_core.recordings.plausibility.check_clock` sees a clock that steps against its
    arrival clock; when the whole device clock goes back (capture and log times together) their
    offset stays and only the order shows it: message ``b`` is captured more than ``limit_s``
    (default ``clock_step_s``) before the latest capture time already read, and the median of the
    ``window`` messages from ``b`` on stays that far back (B-frame reordering, a few frames, and a
    single late message do not). ``ts_ns``, ``log_ns``: (N,) int64 capture and log times, file order.

    Returns:
        ``(b, size_s, device)``: the first message on the new clock, how far it went back (s, one
        interval added: the step from the last old sample to the first new one), and whether the log
        times went back with it; None when the clock never went back.
    """
    limit_ns = (PlausibilityOptions().clock_step_s if limit_s is None else limit_s) * 1e9
    t = np.asarray(ts_ns, dtype=np.int64)
    if len(t) < window + 1:
        return None
    latest = np.maximum.accumulate(t)
    steps = np.diff(t)
    period = float(np.median(steps[steps > 0])) if np.any(steps > 0) else 0.0
    for b in np.flatnonzero(latest[:-1] - t[1:] > limit_ns) + 1:
        if len(t) - b >= window and float(np.median(t[b : b + window])) < latest[b - 1] - limit_ns:
            lt = np.asarray(log_ns, dtype=np.int64)
            device = bool(lt[b] < np.max(lt[:b]) - limit_ns)
            return int(b), (float(latest[b - 1] - t[b]) + period) / 1e9, device
    return None


def _camera_figures(report: RecordingReport, state: _Pass, topics: TopicMap, probe_video: bool) -> int | None:
    """The camera payload hash, the invalid pose fraction and the first decodable frame; returns the
    camera's start for the overlap (that frame's capture time when probed)."""
    path = report.path
    if state.camera_digests:
        digest = hashlib.sha256()
        for ts, d in sorted(state.camera_digests):
            digest.update(int(ts).to_bytes(8, "little", signed=False))
            digest.update(d)
        report.camera_payload_sha256 = digest.hexdigest()

    n_pose = len(state.stats[topics.pose].ts) if topics.pose in state.stats else 0
    if n_pose:
        report.pose_invalid_fraction = state.pose_invalid / n_pose
        if state.pose_invalid:
            report.warnings.append(Problem(
                "pose_invalid",
                f"{path.name}: {state.pose_invalid} of {n_pose} poses ({100 * state.pose_invalid / n_pose:.1f} %) have "
                "pose_valid == false (VIO lost tracking)",
            ))

    camera_start = report.first_ts_ns.get(topics.camera)
    if probe_video and state.camera_heap and report.camera_format.lower() in ("h264", ""):
        packets = sorted(((-neg_ts, -neg_seq), data) for neg_ts, neg_seq, data in state.camera_heap)
        first = _first_decodable([(ts, data) for (ts, _seq), data in packets], state.frame_size)
        if first is None:
            report.errors.append(Problem(
                "no_decodable_frame",
                f"{path.name}: no decodable H.264 frame in the first {len(packets)} camera packets "
                f"({(packets[-1][0][0] - packets[0][0][0]) / 1e9:.3f} s)",
            ))
        else:
            first_ts = packets[first][0][0]
            report.first_decodable_ts_ns = int(first_ts)
            report.leading_undecodable_packets = first
            report.leading_undecodable_s = (first_ts - packets[0][0][0]) / 1e9
            camera_start = int(first_ts)
            if first:
                report.warnings.append(Problem(
                    "leading_undecodable",
                    f"{path.name}: {first} leading H.264 packets ({report.leading_undecodable_s:.3f} s) before the "
                    "first decodable frame (IDR with SPS/PPS); they are skipped",
                ))
    return camera_start


def _check_overlap(report: RecordingReport, topics: TopicMap, camera_start: int | None) -> None:
    """Late starts and early ends of the required streams, and the span they all cover."""
    path, required = report.path, report.required
    present = [t for t in required if t in report.first_ts_ns]
    if present and len(present) == len(required):
        starts = {t: report.first_ts_ns[t] for t in present}
        ends = {t: report.last_ts_ns[t] for t in present}
        earliest, latest = min(starts.values()), max(ends.values())
        for t in present:
            report.start_offsets_s[t] = (starts[t] - earliest) / 1e9
            report.end_offsets_s[t] = (latest - ends[t]) / 1e9
            if report.start_offsets_s[t] > LATE_START_WARN_S:
                report.warnings.append(Problem(
                    "late_start",
                    f"{path.name}: {t} starts {report.start_offsets_s[t]:.3f} s after the first stream; "
                    "trim to the overlap",
                ))
            if report.end_offsets_s[t] > LATE_START_WARN_S:
                report.warnings.append(Problem(
                    "early_end",
                    f"{path.name}: {t} ends {report.end_offsets_s[t]:.3f} s before the last stream; trim to the overlap",
                ))
        if camera_start is not None and topics.camera in starts:
            starts[topics.camera] = camera_start
        report.overlap_start_ns, report.overlap_end_ns = max(starts.values()), min(ends.values())
        report.overlap_s = (report.overlap_end_ns - report.overlap_start_ns) / 1e9
        if report.overlap_s <= 0:
            short = {topics.camera: "camera", topics.pose: "pose", topics.gripper: "gripper"}
            clocks = clock_domain_note({short.get(t, t): starts[t] for t in present})
            if clocks:
                report.errors.append(Problem(
                    "clock_domains_differ",
                    f"{path.name}: {clocks}: the streams do not share a clock, so they cannot be aligned; "
                    "re-export the recording with every header.timestamp on one clock",
                ))
            else:
                report.errors.append(Problem(
                    "no_overlap",
                    f"{path.name}: the required streams do not overlap in time "
                    f"({', '.join(f'{t} {(starts[t] - earliest) / 1e9:.3f}-{(ends[t] - earliest) / 1e9:.3f} s' for t in present)})",
                ))
