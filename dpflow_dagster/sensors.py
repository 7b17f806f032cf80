"""Sensors: request pairing when finished recordings land in the Matrix Studio output root.

The sensor scans ``$DPFLOW_RECORDINGS_ROOT`` (default ``<cwd>/outputs/recordings``),
the folder holding one folder per task (:func:`dpflow_core.pairing.tasks.task_folders`;
a root that itself holds recordings is taken as one task folder). For each task
folder with new finished recordings it adds the task's dynamic partition when
missing and requests ``paired_episodes`` for that partition, in the same tick.
Conversion then runs by its automation condition when ``conversion_automation``
is on; GPU work is never requested by a sensor.

A recording is finished when its three files (``<STEM>.mcap``, ``<STEM>_vio.mcap``,
``<STEM>_vio.json``) are present, the status file holds a final status (success, failed,
or a layout that pairing reports as unknown) and the size and mtime of the stem's files
are the same on two consecutive scans: files still being written or copied are never
paired. The scan is incremental (:mod:`dpflow_core.pairing.watch`): a task folder whose mtime is
unchanged, with nothing waiting, is not even listed, so a tick costs the same over 10 or
30,000 unchanged recordings; ``_vio.json`` files are parsed only when new or changed.
A finished recording rewritten in place (its folder's mtime does not change) is found by
the audit: each tick also fully scans unchanged-looking folders, least recently scanned
first, within ``$DPFLOW_SENSOR_AUDIT_FILES`` stat calls (default 1,000, about 330
recordings: a small root is re-verified on every tick); a folder larger than that is
scanned alone once its last scan is ``$DPFLOW_SENSOR_AUDIT_S`` seconds old (default 600).

Cursor (JSON): ``{"version": 2, "tasks": {task: FolderState}}``
(:class:`dpflow_core.pairing.watch.FolderState`): per task folder a fixed set of fields (the
newest mtime already requested, the folder mtime, one SHA-256 digest over the recordings
waiting for their second look), never a list of every stem; its size does not grow
with the recordings. The run key is a SHA-256 over the task folder and each requested
stem's file names, sizes and mtimes (ns), so a re-recorded stem runs again and an
unchanged one never does. Files copied in with an mtime older than the newest one
already requested (``cp -p``, ``rsync -t``) are not seen: pair them with ``dpflow pair``
or materialise the task's ``paired_episodes`` partition by hand. Folders whose names are
not valid task names are named in the skip reason. Log lines are one per task with new
recordings (a count and the first few stems) and one summary per tick.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dagster as dg

from dpflow_core.errors import DpflowError
from dpflow_core.pairing.tasks import task_folders
from dpflow_core.pairing.watch import (
    DEFAULT_AUDIT_FILES,
    DEFAULT_AUDIT_INTERVAL_S,
    FolderState,
    scan_tick,
    states_from_json,
    states_to_json,
)
from dpflow_dagster.partitions import recordings_root, task_partitions

paired_episodes_job = dg.define_asset_job(
    "paired_episodes_job",
    selection="paired_episodes",
    description="Pair the recordings of a task folder (the partition) into a manifest; requested by recordings_sensor.",
)


def parse_cursor(cursor: str | None) -> dict[str, FolderState]:
    """Task -> :class:`~dpflow_core.pairing.watch.FolderState` from a cursor string.

    An absent or unreadable cursor starts afresh; a version-1 cursor (``max_mtime`` and
    ``pending`` per task) keeps its ``max_mtime``, so requested stems are not requested again.
    """
    try:
        data = json.loads(cursor) if cursor else {}
        if isinstance(data, dict) and "version" not in data:
            return {
                str(task): FolderState(max_mtime_ns=int(float(state["max_mtime"]) * 1e9))
                for task, state in dict(data.get("tasks", {})).items()
            }
        return states_from_json(data)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}


def _env_number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name, "")
    try:
        value = kind(raw) if raw else default
    except ValueError:
        raise DpflowError(f"{name} must be a {kind.__name__} >= 0, got {raw!r}") from None
    if value < 0:
        raise DpflowError(f"{name} must be a {kind.__name__} >= 0, got {raw!r}")
    return value


def _named(stems: list[str], limit: int = 5) -> str:
    shown = ", ".join(stems[:limit])
    return shown + (f" and {len(stems) - limit} more" if len(stems) > limit else "")


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
    folders = task_folders(root)
    tick = scan_tick(
        folders,
        parse_cursor(context.cursor),
        audit_files=int(_env_number("DPFLOW_SENSOR_AUDIT_FILES", DEFAULT_AUDIT_FILES, int)),
        audit_interval_s=_env_number("DPFLOW_SENSOR_AUDIT_S", DEFAULT_AUDIT_INTERVAL_S, float),
    )
    requests, new_partitions, waiting, n_waiting = [], [], [], 0
    for task, result in tick.folders.items():
        folder = folders[task]
        n_waiting += result.state.waiting_n
        waiting += [stem if folder == root else f"{task}/{stem}" for stem in result.state.waiting_names]
        if not result.ready:
            continue
        stems = [s.stem for s in result.ready]
        if not context.instance.has_dynamic_partition(task_partitions.name, task):
            new_partitions.append(task)
        requests.append(dg.RunRequest(
            run_key=run_key_for(folder, result.ready),
            partition_key=task,
            run_config={"ops": {"paired_episodes": {"config": {"root": str(folder)}}}},
            tags={"dpflow/root": str(folder), "dpflow/task": task, "dpflow/new_stems": ",".join(stems)[:1000]},
        ))
        context.log.info(f"{task}: {len(stems)} finished recording(s) under {folder}: {_named(stems)}")
    context.log.info(
        f"{len(folders)} task folder(s) under {root}: {tick.scanned} scanned"
        + (f" ({len(tick.audited)} unchanged-looking, as the audit)" if tick.audited else "")
        + f", {tick.files_statted} file(s) statted, {tick.json_parsed} status file(s) parsed, "
        f"{sum(len(r.ready) for r in tick.folders.values())} recording(s) ready, {n_waiting} waiting"
    )
    cursor = json.dumps(states_to_json({task: r.state for task, r in tick.folders.items()}), sort_keys=True)
    if not requests:
        if n_waiting:
            reason = (
                f"waiting for {n_waiting} recording(s) to finish and stay unchanged for one tick: "
                + ", ".join(waiting[:10]) + (", ..." if n_waiting > len(waiting[:10]) else "")
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
