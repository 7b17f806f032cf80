"""Helpers that build small Matrix Studio recordings and damage them on purpose.

Shared by the recordings, pairing, sensor, asset and conversion tests. Episodes
are small (160x120 px, 2.5 s) so a folder of them is written in about a second.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import IndexType, Writer

from dpflow_core.recordings.samples import SampleEpisode, SampleSpec, write_episode, write_task
from dpflow_core.recordings.topics import DAS_DEFAULT

#: Small, fast sample episodes: 160x120 px, 2.5 s, an IDR every 15 frames.
SMALL = SampleSpec(seconds=2.5, width=160, height=120, gop_size=15)


def write_small_task(out_dir: str | Path, episodes: int = 2, seed: int = 0, task: str = "pick_place",
                     spec: SampleSpec = SMALL) -> list[SampleEpisode]:
    """A task folder ``out_dir/<task>`` of ``episodes`` small episodes (see ``write_task``)."""
    return write_task(out_dir, episodes=episodes, seconds=spec.seconds, seed=seed, task=task, spec=spec)


def write_small_episode(task_dir: str | Path, stem: str, seed: int = 0, **faults) -> SampleEpisode:
    """One small episode with ``SampleSpec`` fault options (e.g. ``camera_start_delay_s=0.4``)."""
    return write_episode(task_dir, stem, replace(SMALL, **faults), seed=seed)


def cut_at_fraction(path: str | Path, fraction: float = 0.6) -> int:
    """Truncate a file to ``fraction`` of its bytes (a recorder killed, a copy interrupted); returns the new size."""
    path = Path(path)
    size = int(path.stat().st_size * fraction)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def cut_closing_magic(path: str | Path) -> int:
    """Remove the last 8 bytes (the closing ``\\x89MCAP0\\r\\n`` magic); returns the new size."""
    path = Path(path)
    assert path.read_bytes()[-8:] == b"\x89MCAP0\r\n"
    return _truncate(path, 8)


def _truncate(path: Path, n_bytes: int) -> int:
    size = path.stat().st_size - n_bytes
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def rewrite_mcap(
    src: str | Path,
    dst: str | Path,
    *,
    chunk_index_only: bool = False,
    encodings: dict[str, str] | None = None,
    duplicate_first: dict[str, int] | None = None,
    overstate_counts: dict[str, int] | None = None,
    drop_messages: tuple[str, ...] = (),
    repeat_timestamp: dict[str, tuple[int, ...]] | None = None,
    add_topics_prefix: str | None = None,
) -> Path:
    """Copy an MCAP's schemas, channels and messages with a plain ``mcap`` Writer.

    Args:
        chunk_index_only: write a summary with chunk indexes only: no message
            index and no statistics (``index_types=CHUNK``, ``use_statistics=False``).
        encodings: per topic, a message encoding to declare instead of the real one
            (e.g. ``{"/robot0/vio/eef_pose": "cbor"}``).
        duplicate_first: per topic, write its first N messages twice (repeated capture times).
        overstate_counts: per topic, add N to the Statistics record's message count
            (a summary that promises messages the data section does not hold).
        drop_messages: topics whose channel is kept but whose messages are left out.
        repeat_timestamp: per topic, indices (file order) of messages whose
            ``header.timestamp`` is set to the previous message's: two different
            payloads with the same capture time (the message is re-encoded with the
            protobuf class built from the file's own schema).
        add_topics_prefix: also write every ``/robot0/...`` channel and its messages a
            second time under this prefix (e.g. ``"/robot1"``): a second arm.
    """
    from mcap_protobuf.decoder import DecoderFactory
    src, dst = Path(src), Path(dst)
    encodings = encodings or {}
    duplicate_first = dict(duplicate_first or {})
    overstate_counts = overstate_counts or {}
    topic_of: dict[int, str] = {}
    tmp = dst.with_name(f".{dst.name}.rewrite")
    kwargs = dict(index_types=IndexType.CHUNK, use_statistics=False) if chunk_index_only else {}
    schema_ids: dict[int, int] = {}
    channel_ids: dict[int, int] = {}
    repeat_timestamp = {t: set(v) for t, v in (repeat_timestamp or {}).items()}
    schemas: dict[int, Schema] = {}
    decoders: dict[int, object] = {}
    seen: dict[str, int] = {}
    last_ts: dict[str, int] = {}
    twin: dict[int, int] = {}
    factory = DecoderFactory()
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        writer = Writer(fout, **kwargs)
        writer.start(profile="", library="dpflow-tests")
        for record in StreamReader(fin).records:
            if isinstance(record, Schema) and record.id not in schema_ids:
                schemas[record.id] = record
                schema_ids[record.id] = writer.register_schema(record.name, record.encoding, record.data)
            elif isinstance(record, Channel) and record.id not in channel_ids:
                channel_ids[record.id] = writer.register_channel(
                    record.topic,
                    encodings.get(record.topic, record.message_encoding),
                    schema_ids.get(record.schema_id, 0),
                    dict(record.metadata),
                )
                topic_of[channel_ids[record.id]] = record.topic
                decoders[channel_ids[record.id]] = factory.decoder_for(record.message_encoding, schemas.get(record.schema_id))
                if add_topics_prefix and record.topic.startswith("/robot0/"):
                    other = add_topics_prefix + record.topic[len("/robot0"):]
                    twin[channel_ids[record.id]] = writer.register_channel(
                        other, record.message_encoding, schema_ids.get(record.schema_id, 0), dict(record.metadata))
                    topic_of[twin[channel_ids[record.id]]] = other
            elif isinstance(record, Message):
                cid = channel_ids[record.channel_id]
                topic = topic_of[cid]
                if topic in drop_messages:
                    continue
                if topic in repeat_timestamp:
                    msg = decoders[cid](record.data)
                    k = seen.get(topic, 0)
                    seen[topic] = k + 1
                    if k in repeat_timestamp[topic]:
                        msg.header.timestamp = last_ts[topic]
                        record = Message(channel_id=record.channel_id, sequence=record.sequence,
                                         log_time=record.log_time, publish_time=record.publish_time,
                                         data=msg.SerializeToString())
                    last_ts[topic] = msg.header.timestamp
                if cid in twin:
                    writer.add_message(twin[cid], record.log_time, record.data, record.publish_time, record.sequence)
                repeats = 2 if duplicate_first.get(topic_of[cid], 0) > 0 else 1
                if repeats == 2:
                    duplicate_first[topic_of[cid]] -= 1
                for _ in range(repeats):
                    writer.add_message(cid, record.log_time, record.data, record.publish_time, record.sequence)
        if overstate_counts:
            stats = writer._Writer__statistics  # the Writer offers no public way to misstate its statistics
            for cid, topic in topic_of.items():
                stats.channel_message_counts[cid] = stats.channel_message_counts.get(cid, 0) + overstate_counts.get(topic, 0)
            stats.message_count += sum(overstate_counts.values())
        writer.finish()
    os.replace(tmp, dst)
    return dst


def set_status(vio_json: str | Path, status: str) -> None:
    """Rewrite the ``status`` of an episode's ``_vio.json``."""
    path = Path(vio_json)
    data = json.loads(path.read_text())
    data["status"] = status
    path.write_text(json.dumps(data, indent=2))


def copy_episode(ep: SampleEpisode, task_dir: str | Path, stem: str) -> dict[str, Path]:
    """Copy an episode's three files under a new stem; returns them by role."""
    task_dir = Path(task_dir)
    out = {
        "raw_mcap": task_dir / f"{stem}.mcap",
        "vio_mcap": task_dir / f"{stem}_vio.mcap",
        "vio_json": task_dir / f"{stem}_vio.json",
    }
    shutil.copyfile(ep.raw_mcap, out["raw_mcap"])
    shutil.copyfile(ep.vio_mcap, out["vio_mcap"])
    shutil.copyfile(ep.vio_json, out["vio_json"])
    return out


TOPICS = DAS_DEFAULT


def refresh_vio_result(task_dir: str | Path, task: str | None = None) -> Path:
    """Rewrite ``vio_result.json`` from the ``_vio.json`` files present (as Matrix Studio would)."""
    task_dir = Path(task_dir)
    success, failed = [], []
    for p in sorted(task_dir.glob("*_vio.json")):
        stem = p.name[: -len("_vio.json")]
        try:
            ok = json.loads(p.read_text()).get("status") == "success"
        except (json.JSONDecodeError, AttributeError):
            ok = False
        (success if ok else failed).append(f"{stem}_vio.mcap" if ok else f"{stem}.mcap")
    path = task_dir / "vio_result.json"
    path.write_text(json.dumps({"task_name": task or task_dir.name, "success_mcap_files": success,
                                "failed_mcap_files": failed}, indent=2))
    return path
