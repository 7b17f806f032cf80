"""Duplicates across task folders: the same recording copied into a second task folder under a new name.

Within one folder :func:`~dpflow_core.pairing.checks.content_rejects` keeps the first copy. A copy in a sibling
task folder (another ``<root>/<task>/`` of the same Matrix Studio output root, the folders the recordings sensor
watches) would otherwise enter a dataset once per task and weigh that demonstration double when both manifests
go into one dataset. :func:`cross_task_rejects` finds it when either folder is paired: each sibling's
``<STEM>_vio.mcap`` of the same size as an accepted one is hashed (sizes first, so a pairing reads no other
file unless a size matches) and a byte-identical one with a ``success`` status is a copy.
"""

from __future__ import annotations

import os
from pathlib import Path

from dpflow_core.files import sha256_file
from dpflow_core.pairing.manifest import AcceptedEpisode, PairingReject
from dpflow_core.pairing.naming import split_name
from dpflow_core.pairing.status import read_vio_status
from dpflow_core.pairing.tasks import task_folders


def _order(path: Path) -> tuple[int, str]:
    """Which copy came first: earlier modification time (ns), then path."""
    try:
        return (path.stat().st_mtime_ns, str(path))
    except OSError:
        return (0, str(path))


def cross_task_rejects(root: Path, accepted: list[AcceptedEpisode]) -> tuple[list[AcceptedEpisode], list[PairingReject]]:
    """Reject the accepted episodes of task folder ``root`` whose ``_vio.mcap`` is a byte copy of an earlier
    one (:func:`_order`) in a sibling task folder, ``duplicate_episode`` naming both paths; the earlier copy
    is kept, whichever folder is paired first. ``root`` without siblings (not a task folder of its parent)
    gives no reject. A sibling file that cannot be read is passed over.

    Returns:
        The episodes kept and the rejects.
    """
    parent = root.parent
    folders = task_folders(parent)
    if root not in folders.values() or not accepted:
        return accepted, []
    sizes = {a.files["vio_mcap"].size_bytes for a in accepted}
    by_size: dict[int, list[tuple[str, Path]]] = {}
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
    hashes: dict[Path, str | None] = {}
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
        if copy is None:
            kept.append(a)
            continue
        rejects.append(PairingReject(
            a.stem, str(a.vio_mcap), "duplicate_episode",
            f"{a.vio_mcap} is a byte copy of {copy} (task folder {copy.parent.name!r}, SHA-256 {mine.sha256[:12]}...), "
            "recorded there first; the same demonstration in two tasks would weigh it double: delete one copy",
        ))
    return kept, rejects
