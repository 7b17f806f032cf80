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


def _rewrite(path: str | Path, topics: tuple[str, ...], emit) -> Path:
    """Rewrite ``path`` in place, every record copied except the messages of ``topics``: for each of those
    (message ``k`` of its topic, file order) ``emit(topic, k, decoded, record)`` gives the messages written in
    its place, as ``(log_time, payload bytes, publish_time)``."""
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
                out = [(record.log_time, record.data, record.publish_time)]
                if topic in topics:
                    k = counts.get(topic, 0)
                    counts[topic] = k + 1
                    out = emit(topic, k, decoders[record.channel_id](record.data), record)
                for log_time, data, publish_time in out:
                    writer.add_message(channel_ids[record.channel_id], log_time, data, publish_time, record.sequence)
        writer.finish()
    os.replace(tmp, path)
    return path


def edit_messages(path: str | Path, topics: tuple[str, ...], edit: Edit) -> Path:
    """Rewrite ``path`` in place with ``edit`` applied to every message of ``topics``."""
    def emit(topic, k, msg, record):
        edit(topic, k, msg)
        return [(record.log_time, msg.SerializeToString(), record.publish_time)]

    return _rewrite(path, topics, emit)

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


def pose_invalid_stretch(path, start: int, stop: int, position_m=(0.0, 0.0, 0.0), identity: bool = False) -> Path:
    """Poses ``start .. stop-1`` flagged ``pose_valid == false`` and holding ``position_m`` (and, with
    ``identity``, the identity rotation): a VIO that lost tracking and wrote garbage (zeros) meanwhile."""
    def edit(_topic, k, msg):
        if start <= k < stop:
            msg.pose_valid = False
            p = msg.pose.position
            p.x, p.y, p.z = position_m
            if identity:
                q = msg.pose.orientation
                q.x, q.y, q.z, q.w = 0.0, 0.0, 0.0, 1.0
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


IMU = DAS_DEFAULT.imu


def imu_from_pose(path, ep, extrinsic_rotvec=(0.0, 0.0, 0.0), noise=0.003, seed=0) -> Path:
    """Every IMU message of a sample episode made what a real IMU, rigidly on the camera, reads:
    the gyro the camera's body rates (rad/s) and the accelerometer the specific force (m/s^2, world
    up +Z), both rotated into the IMU's axes by ``extrinsic_rotvec``, plus noise (ground truth: the
    episode's pose track as written, camera-to-world)."""
    from scipy.spatial.transform import Rotation, Slerp

    t = ep.pose_ts_ns.astype(np.int64)
    ts = (t - t[0]) / 1e9
    slerp = Slerp(ts, Rotation.from_quat(ep.quat_xyzw))
    m = Rotation.from_rotvec(extrinsic_rotvec)
    rng = np.random.default_rng(seed)
    h = 0.01

    def edit(_topic, _k, msg):
        s = float(np.clip((int(msg.header.timestamp) - t[0]) / 1e9, ts[0] + h, ts[-1] - h))
        r0, r1, r2 = slerp([s - h, s, s + h])
        gyro = m.apply((r0.inv() * r2).as_rotvec() / (2 * h))
        p = np.stack([np.interp([s - h, s, s + h], ts, ep.position_m[:, k]) for k in range(3)], axis=1)
        acc = (p[2] - 2 * p[1] + p[0]) / h**2
        force = m.apply(r1.inv().apply(acc + [0.0, 0.0, 9.81]))
        gyro, force = gyro + rng.normal(0, noise, 3), force + rng.normal(0, 10 * noise, 3)
        for v, vals in ((msg.angular_velocity, gyro), (msg.linear_acceleration, force)):
            v.x, v.y, v.z = (float(x) for x in vals)
    return edit_messages(path, (IMU,), edit)


def quaternion_reading(path, reading: str) -> Path:
    """Every pose quaternion stored another way: ``conjugate`` (world-to-camera) or ``wxyz``
    (the four numbers in (w, x, y, z) order where (x, y, z, w) is declared)."""
    def edit(_topic, _k, msg):
        q = msg.pose.orientation
        x, y, z, w = q.x, q.y, q.z, q.w
        if reading == "conjugate":
            q.x, q.y, q.z = -x, -y, -z
        else:
            q.x, q.y, q.z, q.w = w, x, y, z
    return edit_messages(path, (POSE,), edit)


def resend_messages(path: str | Path, topic: str, indices: set[int], delay_ns: int) -> Path:
    """Rewrite ``path`` in place with each message ``k`` in ``indices`` (file order, counted on ``topic``) sent
    twice: the copy, byte for byte the same payload, follows it stamped ``delay_ns`` later (its
    ``header.timestamp`` and log time), as a transport that resends a message does. Ground truth: the
    recording without the copies."""
    def emit(_topic, k, msg, record):
        out = [(record.log_time, record.data, record.publish_time)]
        if k in indices:
            msg.header.timestamp = msg.header.timestamp + delay_ns
            out.append((record.log_time + delay_ns, msg.SerializeToString(), record.publish_time + delay_ns))
        return out

    return _rewrite(path, (topic,), emit)


def still_recording(task_dir, stem: str, spec, seed: int = 0, still_from_s: float = 0.0):
    """A sample episode (``samples.write_episode`` with ``spec``) whose hand moves until ``still_from_s`` and
    then holds still, pose and gripper (ground truth: the returned episode's pose track, constant after
    ``still_from_s``); 0: an entirely still episode, camera and pose."""
    from dpflow_core.recordings import samples

    real = samples.trajectory

    def held(t_s, rng_seed):
        t = np.asarray(t_s, dtype=np.float64)
        pos, rot, width = real(t, rng_seed)
        k = int(np.searchsorted(t, still_from_s))
        pos[k:], rot[k:], width[k:] = pos[k], rot[k], width[k]
        return pos, rot, width

    samples.trajectory = held
    try:
        return samples.write_episode(task_dir, stem, spec, seed=seed)
    finally:
        samples.trajectory = real


def pose_drift(path, ep, from_s: float, velocity_mps: tuple[float, float, float]) -> Path:
    """Every pose captured ``from_s`` after the episode's first pose or later moved by ``velocity_mps``
    x the time since (m): a VIO drifting while the camera holds still (the images say where it truly is)."""
    t0 = int(ep.pose_ts_ns[0])

    def edit(_topic, _k, msg):
        dt = (int(msg.header.timestamp) - t0) / 1e9 - from_s
        if dt > 0:
            p = msg.pose.position
            p.x, p.y, p.z = p.x + velocity_mps[0] * dt, p.y + velocity_mps[1] * dt, p.z + velocity_mps[2] * dt
    return edit_messages(path, (POSE,), edit)


def add_camera(path: str | Path, new_topic: str, source: str = CAMERA) -> Path:
    """Rewrite ``path`` in place with a second camera: every message of ``source`` also written on
    ``new_topic`` (same schema, payload and times), as a recording of a device with another camera does."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.fault")
    with open(path, "rb") as fin, open(tmp, "wb") as fout:
        writer = Writer(fout)
        writer.start(profile="", library="dpflow-fault-fixtures")
        schema_ids: dict[int, int] = {}
        channel_ids: dict[int, list[int]] = {}
        for record in StreamReader(fin).records:
            if isinstance(record, Schema) and record.id not in schema_ids:
                schema_ids[record.id] = writer.register_schema(record.name, record.encoding, record.data)
            elif isinstance(record, Channel) and record.id not in channel_ids:
                topics = [record.topic] + ([new_topic] if record.topic == source else [])
                channel_ids[record.id] = [writer.register_channel(t, record.message_encoding,
                                                                  schema_ids.get(record.schema_id, 0),
                                                                  dict(record.metadata)) for t in topics]
            elif isinstance(record, Message):
                for cid in channel_ids[record.channel_id]:
                    writer.add_message(cid, record.log_time, record.data, record.publish_time, record.sequence)
        writer.finish()
    os.replace(tmp, path)
    return path


def reversed_streams(streams, reversed_units: list):
    """The :class:`~dpflow_core.recordings.samples.EpisodeStreams` of a whole episode played backwards: every
    stream's samples in reverse order, each stamp ``t`` becoming ``first + last - t`` over all streams (so the
    stamps ascend and the streams keep their overlap); ``reversed_units`` the camera's frames re-encoded in reverse
    order (an H.264 stream cannot be played backwards unit by unit). Ground truth: the gyro then turns against the
    pose track, everything else is a consistent recording."""
    import dataclasses

    stamps = [streams.camera_ts_ns, streams.gripper_ts_ns, streams.imu_ts_ns, streams.pose_ts_ns]
    total = min(int(t[0]) for t in stamps) + max(int(t[-1]) for t in stamps)
    back = lambda t: (total - np.asarray(t, np.int64)[::-1]).astype(np.int64)  # noqa: E731
    gyro, acc = streams.imu
    return dataclasses.replace(
        streams, camera_ts_ns=back(streams.camera_ts_ns), access_units=list(reversed_units),
        gripper_ts_ns=back(streams.gripper_ts_ns), gripper_width_m=streams.gripper_width_m[::-1].copy(),
        imu_ts_ns=back(streams.imu_ts_ns), imu=(gyro[::-1].copy(), acc[::-1].copy()), pose_ts_ns=back(streams.pose_ts_ns),
        position_m=streams.position_m[::-1].copy(), quat_xyzw=streams.quat_xyzw[::-1].copy(),
        pose_valid=streams.pose_valid[::-1].copy())


def camera_of(streams, other):
    """``streams`` (an :class:`~dpflow_core.recordings.samples.EpisodeStreams`) with the camera of ``other``, another
    episode's, moved onto this one's clock (its first frame at this camera's first stamp) and cut to this pose
    track's span: the camera stream of another recording, as a copy re-stamped or a hand-edited manifest gives it.
    Every other stream, the IMU included, stays this episode's."""
    import dataclasses

    ts = np.asarray(other.camera_ts_ns, np.int64) - int(other.camera_ts_ns[0]) + int(streams.camera_ts_ns[0])
    keep = ts <= int(streams.pose_ts_ns[-1])
    return dataclasses.replace(streams, camera_ts_ns=ts[keep],
                               access_units=[u for u, k in zip(other.access_units, keep) if k])


def gyro_negated(streams):
    """``streams`` with the IMU's gyro sign flipped (the accelerometer and everything else untouched)."""
    import dataclasses

    gyro, acc = streams.imu
    return dataclasses.replace(streams, imu=(-gyro, acc))


def gripper_shifted(streams, seconds: float):
    """``streams`` with every gripper-width stamp moved by ``seconds`` (+1.0: the widths stamped a second late),
    the widths and every other stream untouched."""
    import dataclasses

    return dataclasses.replace(streams, gripper_ts_ns=np.asarray(streams.gripper_ts_ns, np.int64) + int(round(seconds * 1e9)))


def record_world(root, task: str, seeds, honest: int, variants: dict, size: int = 64) -> dict:
    """A world task folder of honest episodes and faulty variants, paired (ground truth by construction).

    Episode ``k`` (of ``seeds``) is recorded at ``size`` x ``size`` px with its streams kept (``spec``, ``streams`` and
    ``backwards``: the frames re-encoded in reverse order); the first ``honest`` are written as ``<task>_<k:04d>``, the
    rest only serve as variants' bases. ``variants``: stem suffix -> ``(k, make)``, written as ``<task>_<suffix>`` with
    episode ``k``'s spec and the streams ``make(kept)`` gives (``kept``: every episode's dict).

    Returns:
        ``{"dir", "manifest" (the saved manifest's path), "stems" (honest first)}``.
    """
    import json

    import pytest

    import dpflow_core.sim.record as sim_record
    from dpflow_core.pairing import pair_recordings, save_manifest
    from dpflow_core.sim.record import SimRecordingSpec, record_episode
    from dpflow_core.sim.tasks import initial_state, new_world

    task_dir = root / task
    task_dir.mkdir(parents=True)
    world = new_world(task, size, size)
    real_write, real_encode = sim_record.write_recording, sim_record.encode_h264
    kept = []
    try:
        for k, seed in enumerate(seeds):
            got: dict = {}

            def encode(frames, fps, gop, _got=got):
                _got["backwards"] = [u for u, _key in real_encode(frames[::-1], fps, gop)]
                return real_encode(frames, fps, gop)

            def write(task_dir_, stem_, rng, spec, topics, streams, _got=got, _k=k):
                _got.update(spec=spec, streams=streams)
                return real_write(task_dir_, stem_, rng, spec, topics, streams) if _k < honest else None

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sim_record, "encode_h264", encode)
                mp.setattr(sim_record, "write_recording", write)
                record_episode(task_dir, f"{task}_{k:04d}", initial_state(task, seed),
                               SimRecordingSpec(width=size, height=size), world)
            kept.append(got)
    finally:
        world.close()
    assert sim_record.write_recording is real_write and sim_record.encode_h264 is real_encode
    stems = [f"{task}_{k:04d}" for k in range(honest)]
    for suffix, (k, make) in variants.items():
        real_write(task_dir, f"{task}_{suffix}", np.random.default_rng(len(stems)), kept[k]["spec"], DAS_DEFAULT, make(kept))
        stems.append(f"{task}_{suffix}")
    (task_dir / "vio_result.json").write_text(json.dumps({
        "task_name": task, "success_mcap_files": [f"{s}_vio.mcap" for s in stems], "failed_mcap_files": []}))
    manifest = pair_recordings(task_dir)
    assert len(manifest.accepted) == len(stems), manifest.rejected
    path, _ = save_manifest(manifest, root / f"manifests_{task}")
    return {"dir": task_dir, "manifest": path, "stems": stems}
