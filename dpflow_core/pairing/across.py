"""Duplicates across task folders: the same recording copied into a second task folder under a new name.

Within one folder :func:`~dpflow_core.pairing.checks.content_rejects` keeps the first copy. A copy in a sibling
task folder (another ``<root>/<task>/`` of the same Matrix Studio output root, the folders the recordings sensor
watches) would otherwise enter a dataset once per task and weigh that demonstration double when both manifests
go into one dataset. :func:`cross_task_rejects` finds it when either folder is paired: each sibling's
``<STEM>_vio.mcap`` of the same size as an accepted one is hashed (sizes first, so a pairing reads no other
file unless a size matches) and a byte-identical one with a ``success`` status is a copy. A re-muxed copy
(other bytes, the same messages) has another size: a sibling whose summary statistics (its camera's message
count and the file's first and last log time: a few hundred bytes at the end of the file) equal an accepted
episode's gets its camera payload hash (:attr:`~dpflow_core.recordings.RecordingReport.camera_payload_sha256`),
and an equal one is a copy. A sibling without summary statistics is only compared byte for byte.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from mcap.exceptions import McapError
from mcap.reader import SeekingReader

from dpflow_core.errors import RecordingError
from dpflow_core.files import sha256_file
from dpflow_core.pairing.manifest import AcceptedEpisode, PairingReject
from dpflow_core.pairing.naming import split_name
from dpflow_core.pairing.status import read_vio_status
from dpflow_core.pairing.tasks import task_folders
from dpflow_core.recordings import inspect_recording
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


def _order(path: Path) -> tuple[int, str]:
    """Which copy came first: earlier modification time (ns), then path."""
    try:
        return (path.stat().st_mtime_ns, str(path))
    except OSError:
        return (0, str(path))


def _summary_key(path: Path, camera: str) -> tuple[int, int, int] | None:
    """(camera messages, first log time, last log time) from the summary statistics, or None."""
    try:
        with open(path, "rb") as f:
            summary = SeekingReader(f).get_summary()
    except (OSError, McapError, ValueError, struct.error):
        return None
    stats = summary.statistics if summary is not None else None
    if stats is None:
        return None
    n = sum(stats.channel_message_counts.get(cid, 0) for cid, ch in summary.channels.items() if ch.topic == camera)
    return (n, stats.message_start_time, stats.message_end_time) if n else None


def cross_task_rejects(root: Path, accepted: list[AcceptedEpisode],
                       topics: TopicMap = DAS_DEFAULT) -> tuple[list[AcceptedEpisode], list[PairingReject]]:
    """Reject the accepted episodes of task folder ``root`` whose ``_vio.mcap`` is a copy of an earlier one
    (:func:`_order`) in a sibling task folder, byte for byte or re-muxed (the same camera payload hash),
    ``duplicate_episode`` naming both paths; the earlier copy is kept, whichever folder is paired first.
    ``root`` without siblings (not a task folder of its parent) gives no reject. A sibling file that cannot
    be read is passed over.

    Returns:
        The episodes kept and the rejects.
    """
    parent = root.parent
    folders = task_folders(parent)
    if root not in folders.values() or not accepted:
        return accepted, []
    sizes = {a.files["vio_mcap"].size_bytes for a in accepted}
    keys = {a.stem: _summary_key(a.vio_mcap, topics.camera) for a in accepted}
    by_size: dict[int, list[tuple[str, Path]]] = {}
    by_key: dict[tuple[int, int, int], list[tuple[str, Path]]] = {}
    for task, folder in folders.items():
        if folder == root:
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            split = split_name(entry.name)
            if split is None or split[1] != "vio_mcap":
                continue
            try:
                size = entry.stat().st_size
            except OSError:
                continue
            if size in sizes:
                by_size.setdefault(size, []).append((split[0], Path(entry.path)))
            elif any(keys.values()):
                key = _summary_key(Path(entry.path), topics.camera)
                if key is not None and key in keys.values():
                    by_key.setdefault(key, []).append((split[0], Path(entry.path)))
    hashes: dict[Path, str | None] = {}
    camera_hashes: dict[Path, str | None] = {}
    kept, rejects = [], []
    for a in accepted:
        mine = a.files["vio_mcap"]
        copy = None
        for stem, other in by_size.get(mine.size_bytes, []):
            if other not in hashes:
                try:
                    hashes[other] = sha256_file(other)
                except OSError:
                    hashes[other] = None
            if (hashes[other] == mine.sha256 and _order(other) < _order(a.vio_mcap)
                    and read_vio_status(other.with_name(f"{stem}_vio.json")) == "success"):
                copy = other
                break
        if copy is not None:
            rejects.append(PairingReject(
                a.stem, str(a.vio_mcap), "duplicate_episode",
                f"{a.vio_mcap} is a byte copy of {copy} (task folder {copy.parent.name!r}, SHA-256 {mine.sha256[:12]}...), "
                "recorded there first; the same demonstration in two tasks would weigh it double: delete one copy",
            ))
            continue
        cam = a.validation.get("camera_payload_sha256")
        for stem, other in by_key.get(keys[a.stem], []) if cam and keys[a.stem] else []:
            if other not in camera_hashes:
                try:
                    camera_hashes[other] = inspect_recording(other, topics, probe_video=False).camera_payload_sha256
                except (OSError, RecordingError):
                    camera_hashes[other] = None
            if (camera_hashes[other] == cam and _order(other) < _order(a.vio_mcap)
                    and read_vio_status(other.with_name(f"{stem}_vio.json")) == "success"):
                copy = other
                break
        if copy is None:
            kept.append(a)
            continue
        rejects.append(PairingReject(
            a.stem, str(a.vio_mcap), "duplicate_episode",
            f"{a.vio_mcap} holds the same camera stream as {copy} (task folder {copy.parent.name!r}, camera payload "
            f"SHA-256 {cam[:12]}...: a re-muxed copy), recorded there first; the same demonstration in two tasks "
            "would weigh it double: delete one copy",
        ))
    return kept, rejects
