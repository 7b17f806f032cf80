"""The quality report decodes the camera with conversion's decoder (issue 28): packed access units and
B-frames give the report the frame captured at each time, checked by the index drawn into each frame."""

from __future__ import annotations

import numpy as np
import pytest

from dpflow_core.recordings import read_streams
from dpflow_core.report import decode_camera_strip, episode_quality
from test_h264_packing import N, PERIOD_NS, read_marker, streams, write_vio  # noqa: F401 (streams: the fixture)


def _packed(frame_ns, units, packing):
    messages, i = [], 0
    while i < N:
        n = packing.get(i, 1)
        messages.append((int(frame_ns[i]), b"".join(u for u, _ in units[i: i + n])))
        i += n
    return messages


@pytest.mark.parametrize("kind", ["packed", "b_frames"])
def test_report_frames_are_the_frames_captured_at_their_times(tmp_path, streams, kind):
    frame_ns, units, bunits = streams
    if kind == "packed":
        messages = _packed(frame_ns, units, {10: 2, 40: 3})
    else:  # decode order, each message stamped with its frame's capture time
        messages = [(int(frame_ns[pts]), u) for u, pts in bunits]
    path = write_vio(tmp_path / f"{kind}_vio.mcap", frame_ns, messages)
    kept, undecodable, motion_ts, motion = decode_camera_strip(read_streams(path), path, 12)
    assert undecodable == 0 and len(motion_ts) == len(motion) == N and np.all(np.diff(motion_ts) > 0)
    assert len(kept) == 12
    for ts, rgb in kept:
        m = read_marker(rgb)
        assert abs(ts - int(frame_ns[m])) <= PERIOD_NS // 3, (m, ts)
    marks = [read_marker(rgb) for _, rgb in kept]
    assert marks == sorted(marks) and marks[0] == 0 and marks[-1] == N - 1
    manifest = {"task": "t", "root": str(tmp_path), "accepted": [{"stem": kind, "files": {"vio_mcap": {"path": path.name}}}]}
    q, = episode_quality(manifest, tmp_path / "previews")
    assert q.frames_undecodable == 0 and q.preview_png and not [f for f in q.findings if f["stream"] == "camera"]
