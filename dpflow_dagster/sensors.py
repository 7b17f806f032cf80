"""Sensors: request pairing when finished recordings land in the Matrix Studio output folder.

A recording is finished when its three files (``<STEM>.mcap``, ``<STEM>_vio.mcap``,
``<STEM>_vio.json``) are present, the status file holds a final status
(success, failed, or a layout that pairing reports as unknown) and the size and
mtime of the stem's files are the same on two consecutive ticks: files still
being written or copied are never paired.

Cursor (JSON): ``{"max_mtime": float, "pending": {stem: [size_bytes, mtime]}}``.
``max_mtime`` is the newest file mtime of the stems already requested (never the
wall clock); a stem is looked at again only when one of its files is newer than
that, or while it is pending. The run key is a SHA-256 over the root and each
requested stem's file names, sizes and mtimes (ns), so a re-recorded stem runs
again and an unchanged one never does. Files copied in with an mtime older than
``max_mtime`` (``cp -p``, ``rsync -t``) are not seen: pair them with
``dpflow pair`` or materialise ``paired_episodes`` by hand.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg

from dpflow_core.pairing import default_recordings_root, snapshot_stems

paired_episodes_job = dg.define_asset_job(
    "paired_episodes_job",
    selection="paired_episodes",
    description="Pair the recordings of the Matrix Studio task folder into a manifest.",
)


def parse_cursor(cursor: str | None) -> tuple[float, dict[str, list]]:
    """``(max_mtime, pending)`` from a cursor string; an absent or unreadable cursor starts afresh."""
    try:
        data = json.loads(cursor) if cursor else {}
        max_mtime = float(data.get("max_mtime", 0.0))
        pending = {str(k): [int(v[0]), float(v[1])] for k, v in dict(data.get("pending", {})).items()}
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return 0.0, {}
    return max_mtime, pending


def run_key_for(root: Path, snapshots: list) -> str:
    """Run key from content: root plus each stem's file roles, sizes and mtimes (ns)."""
    body = [str(root)] + [
        [s.stem, sorted((role, size, int(round(mtime * 1e9))) for role, (size, mtime) in s.files.items())]
        for s in sorted(snapshots, key=lambda s: s.stem)
    ]
    return "recordings-" + hashlib.sha256(json.dumps(body).encode()).hexdigest()[:24]


@dg.sensor(
    name="recordings_sensor",
    job=paired_episodes_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Requests paired_episodes when finished, stable recordings land in $DPFLOW_RECORDINGS_ROOT.",
)
def recordings_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    root = default_recordings_root().absolute()
    max_mtime, pending = parse_cursor(context.cursor)
    if not root.is_dir():
        return dg.SensorResult(skip_reason=f"{root}: no such folder", cursor=context.cursor)
    snaps = snapshot_stems(root)
    ready, still_pending = [], {}
    for stem, snap in snaps.items():
        if snap.mtime <= max_mtime and stem not in pending:
            continue
        seen = [snap.size_bytes, snap.mtime]
        if snap.final and pending.get(stem) == seen:
            ready.append(snap)
        else:
            still_pending[stem] = seen
    if ready:
        max_mtime = max(max_mtime, *(s.mtime for s in ready))
    cursor = json.dumps({"max_mtime": max_mtime, "pending": still_pending}, sort_keys=True)
    if not ready:
        reason = (
            f"waiting for {len(still_pending)} recording(s) to finish and stay unchanged for one tick: "
            + ", ".join(sorted(still_pending)[:10])
            if still_pending
            else f"no new recordings under {root}"
        )
        return dg.SensorResult(skip_reason=reason, cursor=cursor)
    stems = sorted(s.stem for s in ready)
    request = dg.RunRequest(
        run_key=run_key_for(root, ready),
        run_config={"ops": {"paired_episodes": {"config": {"root": str(root)}}}},
        tags={"dpflow/root": str(root), "dpflow/new_stems": ",".join(stems)[:1000]},
    )
    context.log.info(f"{len(stems)} finished recording(s) under {root}: {', '.join(stems)}")
    return dg.SensorResult(run_requests=[request], cursor=cursor)
