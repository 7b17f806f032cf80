"""What inspecting one recording finds, as data: :class:`RecordingReport` and its :class:`Problem` entries.

:func:`~dpflow_core.recordings.inspection.inspect_recording` fills them in one streaming pass; pairing
stores :meth:`RecordingReport.to_dict` in the manifest. Both names are re-exported by
:mod:`dpflow_core.recordings.inspection` (and :mod:`dpflow_core.recordings`), where they were declared first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`inspect_recording`.

    Attributes:
        code: stable machine-readable code (``snake_case``), e.g. ``truncated_mcap``.
        reason: human sentence naming the topic, count or byte offset concerned.
    """

    code: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "reason": self.reason}


@dataclass
class RecordingReport:
    """Validation figures of one MCAP recording (see :func:`inspect_recording`).

    Times are capture times (``header.timestamp``, ns); offsets and durations in s.

    Attributes:
        path: the file inspected; size_bytes: its size.
        required: the topics that had to be present.
        has_summary: the footer points at a summary section.
        has_chunk_index, has_message_index, has_statistics: which indexes the file holds.
        indexed: all three are present, so a seeking reader can find messages by
            topic and the counts read are checked against the summary statistics.
            When false the file was still read completely, in a streaming pass.
        message_counts: messages read per topic (all topics, streaming pass).
        summary_counts: messages per topic according to the Statistics record, or None.
        schemas, encodings: schema name and message encoding per topic.
        expected_hz: ``header.expect_hz`` of the first message per measured topic.
        rates_hz: measured rate per measured topic, (unique capture times - 1) / span.
        first_ts_ns, last_ts_ns: first and last capture time per measured topic.
        start_offsets_s, end_offsets_s: per required topic, how much later it starts
            than the earliest required stream / how much earlier it ends than the latest.
        overlap_start_ns, overlap_end_ns, overlap_s: the span covered by every required
            stream (the camera counted from its first decodable frame).
        log_time_inversions: per topic, adjacent messages (file order) whose log time decreases.
        duplicate_timestamps: per topic, messages repeating an earlier capture time.
        camera_format: ``format`` field of the first camera message.
        leading_undecodable_packets, leading_undecodable_s: camera packets (and their
            span in s) before the first frame the H.264 decoder outputs; None when not probed.
        first_decodable_ts_ns: capture time of that first frame.
        pose_invalid_fraction: fraction of pose messages with ``pose_valid == false``;
            None when the file has no pose topic.
        camera_payload_sha256: SHA-256 (hex) over the camera payloads in capture order
            (per message: capture time as 8 little-endian bytes, then the SHA-256 of its
            ``data``); equal for two files holding the same camera stream, however they
            were muxed (chunking, compression, message order, other topics). None when
            the file has no camera message.
        sha256: SHA-256 (hex) of the whole file, hashed from the bytes the streaming pass read
            (so a caller needing both reads the file once); not part of :meth:`to_dict`.
        errors: problems that make the file unusable (any error -> reject).
        warnings: faults measured and tolerated (sorted, trimmed or skipped downstream).
    """

    path: Path
    size_bytes: int
    required: tuple[str, ...]
    has_summary: bool = False
    has_chunk_index: bool = False
    has_message_index: bool = False
    has_statistics: bool = False
    message_counts: dict[str, int] = field(default_factory=dict)
    summary_counts: dict[str, int] | None = None
    schemas: dict[str, str] = field(default_factory=dict)
    encodings: dict[str, str] = field(default_factory=dict)
    expected_hz: dict[str, float] = field(default_factory=dict)
    rates_hz: dict[str, float] = field(default_factory=dict)
    first_ts_ns: dict[str, int] = field(default_factory=dict)
    last_ts_ns: dict[str, int] = field(default_factory=dict)
    start_offsets_s: dict[str, float] = field(default_factory=dict)
    end_offsets_s: dict[str, float] = field(default_factory=dict)
    overlap_start_ns: int | None = None
    overlap_end_ns: int | None = None
    overlap_s: float | None = None
    log_time_inversions: dict[str, int] = field(default_factory=dict)
    duplicate_timestamps: dict[str, int] = field(default_factory=dict)
    camera_format: str = ""
    leading_undecodable_packets: int | None = None
    leading_undecodable_s: float | None = None
    first_decodable_ts_ns: int | None = None
    pose_invalid_fraction: float | None = None
    camera_payload_sha256: str | None = None
    sha256: str | None = None
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def indexed(self) -> bool:
        return self.has_summary and self.has_chunk_index and self.has_message_index and self.has_statistics

    @property
    def ok(self) -> bool:
        """True when the file has no errors (warnings are allowed)."""
        return not self.errors

    def to_dict(self) -> dict:
        """JSON-ready figures (the ``validation`` entry of a pairing manifest)."""
        return {
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "indexed": self.indexed,
            "has_summary": self.has_summary,
            "has_chunk_index": self.has_chunk_index,
            "has_message_index": self.has_message_index,
            "has_statistics": self.has_statistics,
            "required_topics": list(self.required),
            "message_counts": dict(self.message_counts),
            "summary_counts": None if self.summary_counts is None else dict(self.summary_counts),
            "schemas": dict(self.schemas),
            "encodings": dict(self.encodings),
            "expected_hz": {k: round(v, 3) for k, v in self.expected_hz.items()},
            "rates_hz": {k: round(v, 3) for k, v in self.rates_hz.items()},
            "first_ts_ns": dict(self.first_ts_ns),
            "last_ts_ns": dict(self.last_ts_ns),
            "start_offsets_s": {k: round(v, 6) for k, v in self.start_offsets_s.items()},
            "end_offsets_s": {k: round(v, 6) for k, v in self.end_offsets_s.items()},
            "overlap_start_ns": self.overlap_start_ns,
            "overlap_end_ns": self.overlap_end_ns,
            "overlap_s": None if self.overlap_s is None else round(self.overlap_s, 6),
            "log_time_inversions": dict(self.log_time_inversions),
            "duplicate_timestamps": dict(self.duplicate_timestamps),
            "camera_format": self.camera_format,
            "leading_undecodable_packets": self.leading_undecodable_packets,
            "leading_undecodable_s": None if self.leading_undecodable_s is None else round(self.leading_undecodable_s, 6),
            "first_decodable_ts_ns": self.first_decodable_ts_ns,
            "pose_invalid_fraction": None if self.pose_invalid_fraction is None else round(self.pose_invalid_fraction, 6),
            "camera_payload_sha256": self.camera_payload_sha256,
            "errors": [p.to_dict() for p in self.errors],
            "warnings": [p.to_dict() for p in self.warnings],
        }
