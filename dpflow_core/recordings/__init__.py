"""Reading Matrix Studio MCAP recordings.

Messages are protobuf, decoded from the FileDescriptorSet schemas embedded in
each file (mcap-protobuf-support), so no compiled protos are needed. Streams are
synchronised on the device ``header.timestamp`` (capture time, ns), never on the
MCAP ``log_time`` (arrival time): messages are sorted by capture time and any
log-time inversions are counted and reported, not fatal.

The file is read in one streaming pass (``NonSeekingReader``), which works with
or without a summary section and message index (a seeking read of an
index-less file would silently return zero messages).

:func:`read_streams` gives the streams for conversion; :func:`inspect_recording`
validates a file and reports its figures and faults as data
(:class:`RecordingReport`), which pairing puts in the manifest.

Modules: :mod:`~dpflow_core.recordings.topics` (topic names), :mod:`~dpflow_core.recordings.reader`,
:mod:`~dpflow_core.recordings.inspection`, :mod:`~dpflow_core.recordings.schemas` (the DAS protobuf
schemas, built in code) and :mod:`~dpflow_core.recordings.samples` (a synthetic recording writer for
tests and the demo). The reader and inspection names are re-exported here.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

# Names are imported from their module on first use (PEP 562): importing one submodule, or this
# package, does not load the others and their dependencies.
__getattr__, __dir__ = lazy_exports(__name__, {
    'H264_PROBE_PACKETS': 'inspection',
    'LATE_START_WARN_S': 'inspection',
    'Problem': 'recording_report',
    'RATE_TOLERANCE': 'inspection',
    'RecordingReport': 'recording_report',
    'inspect_recording': 'inspection',
    'EpisodeStreams': 'reader',
    'read_streams': 'reader',
})

__all__ = [
    "H264_PROBE_PACKETS", "LATE_START_WARN_S", "RATE_TOLERANCE", "EpisodeStreams", "Problem", "RecordingReport",
    "inspect_recording", "read_streams",
]
