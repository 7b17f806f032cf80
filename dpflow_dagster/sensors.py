"""Sensors: request pairing when finished recordings land in the Matrix Studio output root.

The sensor scans ``$DPFLOW_RECORDINGS_ROOT`` (default ``<cwd>/outputs/recordings``),
the folder holding one folder per task (:func:`dpflow_dagster.partitions.task_folders`;
a root that itself holds recordings is taken as one task folder). For each task
folder with new finished recordings it adds the task's dynamic partition when
missing and requests ``paired_episodes`` for that partition, in the same tick.
Conversion then runs by its automation condition when ``conversion_automation``
is on; GPU work is never requested by a sensor.

A recording is finished when its three files (``<STEM>.mcap``, ``<STEM>_vio.mcap``,
``<STEM>_vio.json``) are present, the status file holds a final status
(success, failed, or a layout that pairing reports as unknown) and the size and
mtime of the stem's files are the same on two consecutive ticks: files still
being written or copied are never paired.

Cursor (JSON): ``{"tasks": {task: {"max_mtime": float, "pending": {stem: [size_bytes, mtime]}}}}``.
``max_mtime`` is the newest file mtime of the task's stems already requested (never
the wall clock); a stem is looked at again only when one of its files is newer
than that, or while it is pending. The run key is a SHA-256 over the task folder
and each requested stem's file names, sizes and mtimes (ns), so a re-recorded stem
runs again and an unchanged one never does. Files copied in with an mtime older
than ``max_mtime`` (``cp -p``, ``rsync -t``) are not seen: pair them with
``dpflow pair`` or materialise the task's ``paired_episodes`` partition by hand.
Folders whose names are not valid task names are named in the skip reason.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg

from dpflow_core.pairing import StemSnapshot, snapshot_stems
from dpflow_dagster.partitions import recordings_root, task_folders, task_partitions

paired_episodes_job = dg.define_asset_job(
    "paired_episodes_job",
    selection="paired_episodes",
    description="Pair the recordings of a task folder (the partition) into a manifest; requested by recordings_sensor.",
)


def parse_cursor(cursor: str | None) -> dict[str, tuple[float, dict[str, list]]]:
    """Task -> ``(max_mtime, pending)`` from a cursor string; an absent or unreadable cursor starts afresh."""
    try:
        data = json.loads(cursor) if cursor else {}
        out = {}
        for task, state in dict(data.get("tasks", {})).items():
            max_mtime = float(state.get("max_mtime", 0.0))
            pending = {str(k): [int(v[0]), float(v[1])] for k, v in dict(state.get("pending", {})).items()}
            out[str(task)] = (max_mtime, pending)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}
    return out


def _cursor(state: dict[str, tuple[float, dict[str, list]]]) -> str:
    return json.dumps(
        {"tasks": {task: {"max_mtime": m, "pending": p} for task, (m, p) in state.items()}}, sort_keys=True
    )


def _scan(folder: Path, max_mtime: float, pending: dict[str, list]) -> tuple[list[StemSnapshot], dict[str, list]]:
    """(stems finished and unchanged since the last tick, stems still pending) of one task folder."""
    ready, still_pending = [], {}
    for stem, snap in snapshot_stems(folder).items():
        if snap.mtime <= max_mtime and stem not in pending:
            continue
        seen = [snap.size_bytes, snap.mtime]
        if snap.final and pending.get(stem) == seen:
            ready.append(snap)
        else:
            still_pending[stem] = seen
    return ready, still_pending


def run_key_for(root: Path, snapshots: list) -> str:
    """Run key from content: task folder plus each stem's file roles, sizes and mtimes (ns)."""
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
    description="Adds a task partition and requests its paired_episodes when finished, stable recordings land in "
    "a task folder of $DPFLOW_RECORDINGS_ROOT (the Matrix Studio output root).",
)
def recordings_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    root = recordings_root().absolute()
    if not root.is_dir():
        return dg.SensorResult(skip_reason=f"{root}: no such folder", cursor=context.cursor)
    state = parse_cursor(context.cursor)
    folders = task_folders(root)
    requests, new_partitions, waiting = [], [], []
    for task, folder in folders.items():
        max_mtime, pending = state.get(task, (0.0, {}))
        ready, still_pending = _scan(folder, max_mtime, pending)
        if ready:
            max_mtime = max(max_mtime, *(s.mtime for s in ready))
        state[task] = (max_mtime, still_pending)
        waiting += [stem if folder == root else f"{task}/{stem}" for stem in sorted(still_pending)]
        if not ready:
            continue
        stems = sorted(s.stem for s in ready)
        if not context.instance.has_dynamic_partition(task_partitions.name, task):
            new_partitions.append(task)
        requests.append(dg.RunRequest(
            run_key=run_key_for(folder, ready),
            partition_key=task,
            run_config={"ops": {"paired_episodes": {"config": {"root": str(folder)}}}},
            tags={"dpflow/root": str(folder), "dpflow/task": task, "dpflow/new_stems": ",".join(stems)[:1000]},
        ))
        context.log.info(f"{task}: {len(stems)} finished recording(s) under {folder}: {', '.join(stems)}")
    cursor = _cursor(state)
    if not requests:
        if waiting:
            reason = (
                f"waiting for {len(waiting)} recording(s) to finish and stay unchanged for one tick: "
                + ", ".join(waiting[:10])
            )
        else:
            reason = f"no new recordings under {root}"
            ignored = [] if root in folders.values() else sorted(
                p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p not in folders.values()
            )
            if ignored:
                reason += f"; folders ignored (not valid task names): {', '.join(map(repr, ignored[:10]))}"
        return dg.SensorResult(skip_reason=reason, cursor=cursor)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[task_partitions.build_add_request(new_partitions)] if new_partitions else None,
        cursor=cursor,
    )


#: Assets whose automation condition (``partitions.CONVERSION_AUTOMATION``) this sensor evaluates.
CONVERSION_ASSETS = ("dataset_npz", "lerobot_dataset", "norm_stats")

conversion_automation = dg.AutomationConditionSensorDefinition(
    "conversion_automation",
    target=dg.AssetSelection.assets(*CONVERSION_ASSETS),
    default_status=dg.DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=30,
    description="Converts a task's paired episodes (dataset.npz, LeRobot export, openpi norm stats) once they are "
    "new and their upstream blocking checks passed. CPU work only: GPU assets have no automation condition.",
)
