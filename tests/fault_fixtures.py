"""A generator of plausibility faults with ground truth (issue 28): well-formed recordings whose
content is physically wrong.

Each fault rewrites one stream of a sample episode's ``_vio.mcap`` (every message decoded with the
file's own protobuf schema, edited, re-encoded; all other records copied): the caller knows from
its arguments exactly which samples are wrong, by how much and when, and the untouched
:class:`~dpflow_core.recordings.samples.SampleEpisode` ground truth says what the right values are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import Writer
from mcap_protobuf.decoder import DecoderFactory

from dpflow_core.recordings.topics import DAS_DEFAULT

POSE, GRIPPER, CAMERA = DAS_DEFAULT.pose, DAS_DEFAULT.gripper, DAS_DEFAULT.camera

#: edit(topic, k, message) -> None: change message k (file order, counted per topic) in place.
Edit = Callable[[str, int, object], None]


def edit_messages(path: str | Path, topics: tuple[str, ...], edit: Edit) -> Path:
    """Rewrite ``path`` in place with ``edit`` applied to every message of ``topics``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.fault")
    factory = DecoderFactory()
    schemas: dict[int, Schema] = {}
    decoders: dict[int, object] = {}
    topic_of: dict[int, str] = {}
    counts: dict[str, int] = {}
    with open(path, "rb") as fin, open(tmp, "wb") as fout:
        writer = Writer(fout)
        writer.start(profile="", library="dpflow-fault-fixtures")
        schema_ids: dict[int, int] = {}
        channel_ids: dict[int, int] = {}
        for record in StreamReader(fin).records:
            if isinstance(record, Schema) and record.id not in schema_ids:
                schemas[record.id] = record
                schema_ids[record.id] = writer.register_schema(record.name, record.encoding, record.data)
            elif isinstance(record, Channel) and record.id not in channel_ids:
                channel_ids[record.id] = writer.register_channel(record.topic, record.message_encoding,
                                                                 schema_ids.get(record.schema_id, 0), dict(record.metadata))
                topic_of[record.id] = record.topic
                decoders[record.id] = factory.decoder_for(record.message_encoding, schemas.get(record.schema_id))
            elif isinstance(record, Message):
                topic = topic_of[record.channel_id]
                data = record.data
                if topic in topics:
                    msg = decoders[record.channel_id](record.data)
                    k = counts.get(topic, 0)
                    counts[topic] = k + 1
                    edit(topic, k, msg)
                    data = msg.SerializeToString()
                writer.add_message(channel_ids[record.channel_id], record.log_time, data, record.publish_time,
                                   record.sequence)
        writer.finish()
    os.replace(tmp, path)
    return path


def pose_spikes(path, indices: dict[int, tuple[float, float, float]]) -> Path:
    """Pose samples ``k`` (file order) moved by the given offset (m): single-sample outliers."""
    def edit(_topic, k, msg):
        if k in indices:
            p = msg.pose.position
            p.x, p.y, p.z = p.x + indices[k][0], p.y + indices[k][1], p.z + indices[k][2]
    return edit_messages(path, (POSE,), edit)


def pose_jump(path, from_index: int, offset_m: tuple[float, float, float]) -> Path:
    """Every pose from sample ``from_index`` on offset by ``offset_m``: a VIO relocalisation jump."""
    def edit(_topic, k, msg):
        if k >= from_index:
            p = msg.pose.position
            p.x, p.y, p.z = p.x + offset_m[0], p.y + offset_m[1], p.z + offset_m[2]
    return edit_messages(path, (POSE,), edit)


def vio_freeze(path, start: int, stop: int) -> Path:
    """Poses ``start+1 .. stop-1`` repeat pose ``start`` exactly: a VIO that froze while the camera moved."""
    held: dict = {}

    def edit(_topic, k, msg):
        if k == start:
            held["p"] = (msg.pose.position.x, msg.pose.position.y, msg.pose.position.z)
            q = msg.pose.orientation
            held["q"] = (q.x, q.y, q.z, q.w)
        elif start < k < stop:
            p, q = msg.pose.position, msg.pose.orientation
            p.x, p.y, p.z = held["p"]
            q.x, q.y, q.z, q.w = held["q"]
    return edit_messages(path, (POSE,), edit)


def gripper_values(path, values: Callable[[int, float], float]) -> Path:
    """Each gripper width ``value`` of sample ``k`` replaced by ``values(k, value)``."""
    def edit(_topic, k, msg):
        msg.value = float(values(k, msg.value))
    return edit_messages(path, (GRIPPER,), edit)


def clock_shift(path, topic: str, from_index: int, shift_ns: int) -> Path:
    """``header.timestamp`` of ``topic``'s messages from ``from_index`` (file order) on moved by
    ``shift_ns`` while their arrival (log) times stay: a step (> 0) or reversal (< 0) of its clock."""
    def edit(_topic, k, msg):
        if k >= from_index:
            msg.header.timestamp = int(msg.header.timestamp) + int(shift_ns)
    return edit_messages(path, (topic,), edit)


def interp_truth(ep, t_ns: np.ndarray) -> np.ndarray:
    """Ground-truth positions (m) of a sample episode at capture times ``t_ns``."""
    pose_t = ep.pose_ts_ns.astype(np.int64)
    return np.stack([np.interp(t_ns, pose_t, ep.position_m[:, k]) for k in range(3)], axis=1)
