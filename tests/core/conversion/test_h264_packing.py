"""H.264 as the standard allows it (issue 28): any number of access units per camera message, and
B-frames decoded in decode order and placed by presentation time.

Every frame carries its own index drawn into it (10 bits as black and white squares), so each
kept row of an aligned episode is checked to be the frame captured at the row's time: frame
identity, not a count of frames.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core.conversion import ConversionSettings, align_episode
from dpflow_core.recordings import read_streams, samples
from dpflow_core.recordings.reader import has_b_slice
from dpflow_core.recordings.schemas import das_messages
from dpflow_core.recordings.topics import DAS_DEFAULT

FPS, N, W, H, BITS, CELL = 30.0, 75, 160, 120, 10, 16
PERIOD_NS = int(1e9 / FPS)


def marked_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """(H, W, 3) uint8 BGR frames; frame i shows i in binary along its top (one 16 px square a
    bit, white = 1) over a texture that slides one pixel a frame (the camera moves)."""
    rng = np.random.default_rng(seed)
    texture = rng.integers(60, 200, (H, W + n, 3), dtype=np.uint8)
    out = []
    for i in range(n):
        img = texture[:, i : i + W].copy()
        img[:CELL] = 128
        for b in range(BITS):
            img[2 : CELL - 2, b * CELL + 2 : (b + 1) * CELL - 2] = 255 if (i >> b) & 1 else 0
        out.append(img)
    return out


def read_marker(rgb: np.ndarray) -> int:
    """The index drawn by :func:`marked_frames` into a decoded (H, W, 3) frame at full size."""
    cells = [rgb[4 : CELL - 4, b * CELL + 4 : (b + 1) * CELL - 4].mean() for b in range(BITS)]
    return sum(1 << b for b, v in enumerate(cells) if v > 128)


def encode(frames: list[np.ndarray], b_frames: int) -> list[tuple[bytes, int]]:
    """Access units in decode order with the index of the frame each encodes (its pts)."""
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = W, H, "yuv420p"
    ctx.time_base, ctx.framerate = Fraction(1, int(FPS)), Fraction(int(FPS), 1)
    ctx.gop_size, ctx.max_b_frames = 25, b_frames
    opts = {"preset": "ultrafast", "crf": "20", "x264-params": "keyint=25:min-keyint=25:scenecut=0"}
    if b_frames:
        opts["bf"] = str(b_frames)
    else:
        opts["tune"] = "zerolatency"
    ctx.options = opts
    units = []
    for i, img in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(img, format="bgr24").reformat(format="yuv420p")
        frame.pts = i
        units += [(bytes(p), int(p.pts)) for p in ctx.encode(frame)]
    units += [(bytes(p), int(p.pts)) for p in ctx.encode(None)]
    assert len(units) == len(frames)
    return units


def write_vio(path: Path, frame_ns: np.ndarray, messages: list[tuple[int, bytes]], seed: int = 1) -> Path:
    """A ``_vio.mcap`` whose camera messages are ``messages`` [(capture time ns, payload)], written
    in that (decode) order with increasing sequence numbers, and a smooth pose and gripper track."""
    msgs, t = das_messages(), DAS_DEFAULT
    records = []
    for seq, (ts, data) in enumerate(messages):
        # arrival: after the frame two periods later is captured (a B-frame encoder's delay)
        log = int(frame_ns[0]) + (seq + 2) * PERIOD_NS + 5_000_000
        records.append((log, t.camera, msgs.CompressedImage(
            header=samples.device_header(msgs, t.camera, seq, ts, FPS), frame_id="camera0", data=data, format="h264")))
    pose_ns = frame_ns[0] - 20_000_000 + np.arange(int(len(frame_ns) * 1.1) + 4) * PERIOD_NS
    pos, rotvec, width = samples.trajectory((pose_ns - pose_ns[0]) / 1e9, seed)
    quat = Rotation.from_rotvec(rotvec).as_quat()
    for seq, ts in enumerate(pose_ns):
        p = msgs.PoseInFrame(header=samples.device_header(msgs, t.pose, seq, int(ts), FPS), frame_id="world",
                             pose_valid=True, score=0.9)
        p.pose.position.x, p.pose.position.y, p.pose.position.z = pos[seq]
        p.pose.orientation.x, p.pose.orientation.y, p.pose.orientation.z, p.pose.orientation.w = quat[seq]
        records.append((int(ts) + 30_000_000, t.pose, p))
    for seq, ts in enumerate(pose_ns[::2]):
        records.append((int(ts) + 1_000_000, t.gripper, msgs.MagneticEncoderMeasurement(
            header=samples.device_header(msgs, t.gripper, seq, int(ts), FPS / 2), value=float(width[2 * seq]))))
    records.sort(key=lambda r: r[0])
    samples.write_mcap(path, records)
    return path


@pytest.fixture(scope="module")
def streams():
    frames = marked_frames(N)
    rng = np.random.default_rng(5)
    frame_ns = 1_700_000_000_000_000_000 + np.arange(N) * PERIOD_NS + rng.integers(-300_000, 300_000, N)
    return frame_ns, encode(frames, 0), encode(frames, 2)


def check_identity(a, frame_ns: np.ndarray, exact: set[int] = frozenset()) -> list[int]:
    """Each row shows the frame captured at its time (exactly for frames in their own message,
    within a third of a period for the others); returns the row markers."""
    marks = [read_marker(np.asarray(r)) for r in a.rgb]
    for row, m in enumerate(marks):
        err = abs(int(a.camera_ts_ns[row]) - int(frame_ns[m]))
        assert err <= (0 if m in exact else PERIOD_NS // 3), (row, m, err)
    assert marks == list(range(marks[0], marks[0] + len(marks))), marks
    return marks


def test_marker_survives_the_codec(streams):
    frames = marked_frames(N)
    assert [read_marker(f[..., ::-1]) for f in frames] == list(range(N))


@pytest.mark.parametrize("packing", [
    {10: 2},                # two units in message 10, the next message missing
    {10: 2, 40: 3},         # two packings, one of three units
    {5: 2, 6: 2, 60: 2},    # neighbours both packed, and one late in the stream
])
def test_several_access_units_in_one_message(tmp_path, streams, packing):
    frame_ns, units, _ = streams
    messages, i, single = [], 0, set()
    while i < N:
        n = packing.get(i, 1)
        messages.append((int(frame_ns[i]), b"".join(u for u, _ in units[i : i + n])))
        if n == 1:
            single.add(i)
        i += n
    a = align_episode(write_vio(tmp_path / "packed_vio.mcap", frame_ns, messages), ConversionSettings(image_size=None))
    assert a.report["camera_messages"] == len(messages)
    assert a.report["decoded_frames"] == N
    marks = check_identity(a, frame_ns, single)
    assert len(marks) >= N - 4
    assert a.report["gaps"] == []  # the packed units fill their messages' holes: nothing interpolated


def test_packed_units_whose_message_is_stamped_at_the_last_one(tmp_path, streams):
    """The hole precedes the message: its units end at its time."""
    frame_ns, units, _ = streams
    messages = [(int(frame_ns[k]), u) for k, (u, _) in enumerate(units) if k not in (20, 21)]
    messages.insert(20, (int(frame_ns[22]), units[20][0] + units[21][0] + units[22][0]))
    messages.pop(21)
    a = align_episode(write_vio(tmp_path / "late_vio.mcap", frame_ns, messages), ConversionSettings(image_size=None))
    check_identity(a, frame_ns, set(range(N)) - {20, 21, 22})


@pytest.mark.parametrize("stamps", ["presentation", "decode"])
def test_b_frames_placed_by_presentation_time(tmp_path, streams, stamps):
    frame_ns, _, bunits = streams
    assert [pts for _, pts in bunits] != sorted(pts for _, pts in bunits)  # the encoder reordered
    if stamps == "presentation":  # each message stamped with its frame's capture time
        messages = [(int(frame_ns[pts]), u) for u, pts in bunits]
    else:  # stamped in decode order: the k-th message carries the k-th capture time
        messages = [(int(frame_ns[k]), u) for k, (u, _) in enumerate(bunits)]
    path = write_vio(tmp_path / f"b_{stamps}_vio.mcap", frame_ns, messages)
    s = read_streams(path)
    assert (s.camera_decode_order is not None) == (stamps == "presentation")
    a = align_episode(path, ConversionSettings(image_size=None))
    assert a.report["decoded_frames"] == N and a.report["undecodable_packets"] == 0
    marks = check_identity(a, frame_ns, set(range(N)))
    assert len(marks) >= N - 4


def test_b_frames_with_two_units_in_a_message(tmp_path, streams):
    frame_ns, _, bunits = streams
    messages = [(int(frame_ns[pts]), u) for u, pts in bunits]
    k = 30  # merge decode positions k and k + 1 into one message, stamped with the first's time
    messages[k] = (messages[k][0], messages[k][1] + messages[k + 1][1])
    del messages[k + 1]
    a = align_episode(write_vio(tmp_path / "b_packed_vio.mcap", frame_ns, messages),
                      ConversionSettings(image_size=None))
    marks = check_identity(a, frame_ns, {pts for _, pts in bunits} - {bunits[k][1], bunits[k + 1][1]})
    assert a.report["decoded_frames"] == N and len(marks) >= N - 4


def test_b_slices_found_in_the_slice_headers(streams):
    _, units, bunits = streams
    assert not any(has_b_slice(u) for u, _ in units)
    # ground truth from the encoder: a frame shown before one decoded earlier is a B-frame
    shown_late = [pts < max(p for _, p in bunits[: k + 1]) for k, (_, pts) in enumerate(bunits)]
    assert any(shown_late)
    assert [has_b_slice(u) for u, _ in bunits] == shown_late


def test_sequence_numbers_out_of_capture_order_without_b_frames_keep_capture_order(tmp_path, streams):
    frame_ns, units, _ = streams
    messages = [(int(frame_ns[k]), u) for k, (u, _) in enumerate(units)]
    messages[30], messages[31] = messages[31], messages[30]  # sequence numbers now disagree with capture
    path = write_vio(tmp_path / "swapped_vio.mcap", frame_ns, messages)
    assert read_streams(path).camera_decode_order is None
    check_identity(align_episode(path, ConversionSettings(image_size=None)), frame_ns, set(range(N)))
