"""The export job: a pairing manifest in, a LeRobot dataset (v3.0 or v2.1) out.

Takes a manifest and options (image size, action rule, task text, workers); aligns each accepted
episode with the conversion's own alignment (worker processes) and writes it with
:class:`~dpflow_core.export.writer.LeRobotWriter` under a content-addressed key; gives a
:class:`LeRobotExport` (path, episodes, frames, fps in Hz).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dpflow_core import __version__
from dpflow_core.conversion import (
    CONVERTER_VERSION, ConversionSettings, align_job_episode, alignment_job, load_inputs,
)
from dpflow_core.conversion.align import ALIGN_IMPORTS
from dpflow_core.conversion.jobs import die_with_parent
from dpflow_core.errors import STORAGE_ERRNOS, ConversionError, DatasetError, DpflowError, storage_error
from dpflow_core.files import os_errors_named
from dpflow_core.export.features import (
    CAMERA_KEY, PROVENANCE_PATH, episode_state,
)
from dpflow_core.export.validation import read_metadata_json, validate_lerobot_dataset
from dpflow_core.export.settings import ExportSettings, parse_image_size  # noqa: F401 (parse_image_size re-exported)
from dpflow_core.export.video import VideoSpec
from dpflow_core.export.writer import LeRobotExport, LeRobotWriter
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


def _align_job(job: dict) -> dict:
    """Worker: align one episode with ``align_episode``; frames go to a ``.npy`` memory map.

    Returns the arrays except the frames (``rgb_path``/``rgb_rows`` locate them),
    or ``{"ok": False, "code", "reason"}``; frames never travel through the pipe.
    """
    stem = job["stem"]
    try:
        ep = align_job_episode(job, job["rgb_dir"])
        if hasattr(ep.rgb, "flush"):
            ep.rgb.flush()
        return {
            "ok": True,
            "stem": stem,
            "timestamps_s": ep.timestamps_s,
            "state": episode_state(ep.eef_pos, ep.eef_rot_axis_angle, ep.gripper_width),
            "rgb_path": str(ep.rgb_path),
            "rgb_rows": ep.rgb_rows,
            "report": ep.report,
        }
    except DpflowError as exc:
        return {"ok": False, "stem": stem, "code": exc.code, "reason": str(exc)}
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:  # the staging folder's disk, not this episode, is at fault
            return {"ok": False, "stem": stem, "code": "storage", "errno": exc.errno, "reason": exc.strerror or str(exc)}
        return {"ok": False, "stem": stem, "code": "unreadable",
                "reason": f"{exc.filename or job['vio_mcap']}: cannot read: {exc.strerror or exc} (errno {exc.errno})"}


def _aligned_in_order(jobs: list[dict], workers: int) -> Iterator[dict]:
    """Results of :func:`_align_job` in job order; at most ``2 * workers`` jobs in flight
    (bounding the decoded frames waiting on disk)."""
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_align_job, jobs)
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dpflow_core.export.export", *ALIGN_IMPORTS])  # imported once, not per worker
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx,
                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        pending: deque = deque()
        it = iter(jobs)
        for job in it:
            pending.append((job, pool.submit(_align_job, job)))
            if len(pending) >= 2 * workers:
                break
        while pending:
            job, fut = pending.popleft()
            try:
                yield fut.result()
            except Exception as exc:  # noqa: BLE001 - a dead worker rejects its episode, not the export
                yield {"ok": False, "stem": job["stem"], "code": "internal_error", "reason": f"{type(exc).__name__}: {exc}"}
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_align_job, nxt)))


def _export_key(inputs: Any, options: dict) -> str:
    doc = {
        "converter_version": CONVERTER_VERSION,
        "options": options,
        "inputs": sorted([e.stem, e.sha256] for e in inputs.episodes),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def lerobot_path_in(workdir: str | Path, manifest: Any, task: str, settings: ExportSettings | None = None, *,
                    topics: TopicMap = DAS_DEFAULT, video: VideoSpec = VideoSpec()) -> Path:
    """The content-addressed place of an export in a work folder: ``<workdir>/lerobot/<task>/<key16>``.

    ``key16`` is the first 16 hex digits of :func:`export_key` of ``manifest`` and ``settings``: the same inputs
    and settings find the same folder, other settings never overwrite it.
    """
    return Path(workdir) / "lerobot" / task / export_key(manifest, settings, topics=topics, video=video)[:16]


def _options(inputs: Any, settings: ExportSettings, topics: TopicMap, video: VideoSpec) -> dict:
    """What the export key hashes and ``meta/dpflow.json`` records: the settings, the topics and the encoder."""
    size = settings.image_size
    return {
        "task": settings.task_text if settings.task_text is not None else inputs.task or Path(inputs.root or "dataset").name,
        "action_rule": settings.action_rule,
        "image_size": None if size is None else [int(size[0]), int(size[1])],
        "invalid_pose_policy": settings.invalid_pose_policy,
        "min_overlap_fraction": settings.min_overlap_fraction,
        "frequency_tolerance": settings.frequency_tolerance,
        "topics": {"camera": topics.camera, "pose": topics.pose, "gripper": topics.gripper},
        "video": dataclasses.asdict(video),
        "codebase_version": settings.codebase_version,
        "rotation": settings.rotation,
        "rate_policy": settings.rate_policy,
    }


def export_key(manifest: Any, settings: ExportSettings | None = None, *, topics: TopicMap = DAS_DEFAULT,
               video: VideoSpec = VideoSpec()) -> str:
    """Content address of the export :func:`export_lerobot` would make (64 hex digits).

    SHA-256 of the accepted inputs' stems and ``_vio.mcap`` hashes, the settings (the LeRobot format among
    them), the topics, the encoder and the converter version. Use it to name an output folder: equal keys
    mean the same export of the same bytes.

    Raises:
        PairingError, ConversionError: the manifest cannot be read (:func:`~dpflow_core.conversion.load_inputs`).
    """
    inputs = load_inputs(manifest)
    return _export_key(inputs, _options(inputs, settings or ExportSettings(), topics, video))


def load_export(dataset_dir: str | Path) -> LeRobotExport:
    """The summary of a dataset written by :class:`LeRobotWriter`, read back from its metadata.

    Raises:
        DatasetError: ``meta/info.json`` or ``meta/dpflow.json`` is missing or
            malformed, or the version is none of :data:`FORMATS`.
    """
    layout = validate_lerobot_dataset(dataset_dir)
    path = layout.root / PROVENANCE_PATH
    if not path.is_file():
        raise DatasetError(f"{PROVENANCE_PATH} not found: not written by dpflow", path, code="missing_metadata")
    record = read_metadata_json(path, PROVENANCE_PATH)
    info = layout.info
    try:
        videos = [k for k, ft in info["features"].items() if ft.get("dtype") == "video"]
        h, w = info["features"][videos[0]]["shape"][:2]
        return LeRobotExport(
            path=layout.root.absolute(),
            fps=float(info["fps"]),
            n_episodes=int(info["total_episodes"]),
            total_frames=int(info["total_frames"]),
            video_keys=videos,
            image_size=[int(w), int(h)],
            action_rule=record["action_rule"],
            task=record["options"]["task"] if "options" in record else record.get("task", ""),
            stems=[e["stem"] for e in record["episodes"]],
            skipped=dict(record.get("skipped", {})),
            export_key=record.get("export_key"),
            codebase_version=info["codebase_version"],
            resampled=[e["stem"] for e in record["episodes"] if "resampled" in e],
            rate_groups=list(record.get("rate_groups", [])),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise DatasetError(f"metadata lacks a field: {exc!r}", path, code="bad_metadata") from exc


def export_lerobot(
    manifest: Any,
    out_dir: str | Path,
    settings: ExportSettings | None = None,
    *,
    topics: TopicMap = DAS_DEFAULT,
    verify_sha256: bool = True,
    workers: int = 0,
    video: VideoSpec = VideoSpec(),
    reuse_existing: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> LeRobotExport:
    """Export the accepted episodes of a pairing manifest as a LeRobot dataset, v3.0 (default) or v2.1.

    Both formats come from the same aligned episodes and the same video encoding
    (:class:`LeRobotWriter`); only the files they are laid out in differ.

    The manifest is read by :func:`dpflow_core.conversion.load_inputs` and each
    episode decoded and aligned by :func:`dpflow_core.conversion.align_episode`,
    exactly as for ``dataset.npz``, in worker processes: inputs are checked
    against the manifest's size and SHA-256 first. Its state is
    :func:`episode_state`, its actions :func:`episode_actions`, its camera0
    frames the video :data:`CAMERA_KEY`. Episodes that cannot be aligned are
    skipped with their reason; one at another rate than its task's is resampled,
    written as a dataset of its own or skipped by ``rate_policy`` (the
    conversion's rule, :mod:`dpflow_core.export.rates`); ``fps`` is :func:`measured_fps`. ``meta/dpflow.json`` records
    the manifest, every input's SHA-256 and every alignment report.

    Args:
        manifest: a pairing manifest (path, ``Manifest``, dict; see ``load_inputs``).
        out_dir: dataset folder to create; must not exist.
        settings: what decides the export's content (:class:`~dpflow_core.export.settings.ExportSettings`;
            default: its defaults): task text, action rule, frame size, pose and rate policies, format, rotation.
        topics: see ``align_episode``.
        verify_sha256: hash each input and compare with the manifest.
        workers: alignment worker processes; 0 = the number of CPU cores.
        video: encoder settings.
        reuse_existing: when ``out_dir`` holds an export with the same
            :func:`export_key` (same input hashes and options), return it
            (``reused=True``) instead of failing.
        progress: called as ``progress(stem, done, total)`` after each episode.

    Returns:
        The export summary.

    Raises:
        PairingError: the manifest is missing or malformed.
        ConversionError: ``out_dir`` exists (``output_exists``; with
            ``reuse_existing``: holds another export), an option is
            invalid (``bad_option``), or no episode survived (``no_valid_episodes``).
    """
    s = settings or ExportSettings()
    inputs = load_inputs(manifest)
    options = _options(inputs, s, topics, video)
    task = options["task"]
    key = _export_key(inputs, options)
    if Path(out_dir).exists():
        return _existing_export(out_dir, key, reuse_existing)
    source = inputs.manifests[0] if inputs.manifests else None
    if not inputs.episodes:
        raise ConversionError(f"no valid episodes: the manifest accepts none ({len(inputs.rejected)} rejected)",
                              source, code="no_valid_episodes")
    n_workers = workers if workers and workers > 0 else (os.cpu_count() or 1)
    with os_errors_named(out_dir, "writing the LeRobot export"), LeRobotWriter(
            out_dir, task, s.action_rule, video=video, codebase_version=s.codebase_version, rotation=s.rotation) as writer:
        rgb_dir = writer.staging_dir / "frames"
        rgb_dir.mkdir()
        # gap_policy "reject": a LeRobot episode cannot be stored in pieces, so a camera hole is never bridged.
        aligning = ConversionSettings(image_size=s.image_size, invalid_pose_policy=s.invalid_pose_policy,
                                      min_overlap_fraction=s.min_overlap_fraction, gap_policy="reject")
        jobs = [alignment_job(e, aligning, topics, verify_sha256) | {"rgb_dir": str(rgb_dir)} for e in inputs.episodes]
        files = {e.stem: e.files for e in inputs.episodes}
        skipped = _write_episodes(writer, jobs, files, n_workers, out_dir, progress)
        if not len(writer):
            raise ConversionError(f"no valid episodes: {len(jobs)} found, all rejected: {skipped}", source, code="no_valid_episodes")
        provenance = {
            "export_key": key,
            "manifests": inputs.manifests,
            "root": inputs.root,
            "options": options,
            "converter_version": CONVERTER_VERSION,
            "dpflow_version": __version__,
            "rejected_by_pairing": inputs.rejected,
            "skipped": skipped,
        }
        return writer.finish(s.frequency_tolerance, provenance, s.rate_policy)


def _existing_export(out_dir: str | Path, key: str, reuse_existing: bool) -> LeRobotExport:
    """The export already in ``out_dir`` when it has the same ``key`` and ``reuse_existing``, marked reused.

    Raises:
        ConversionError: ``output_exists`` otherwise (nothing is overwritten).
    """
    if reuse_existing:
        existing = load_export(out_dir)
        if existing.export_key == key:
            return dataclasses.replace(existing, reused=True)
        raise ConversionError(
            f"output folder holds another export (export_key {existing.export_key}, this one {key})",
            out_dir,
            code="output_exists",
        )
    raise ConversionError("output folder already exists; choose a new one (nothing is overwritten)", out_dir, code="output_exists")


def _write_episodes(
    writer: LeRobotWriter, jobs: list[dict], files: Mapping[str, Any], n_workers: int, out_dir: str | Path,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, str]:
    """Align the episodes of ``jobs`` in ``n_workers`` processes and add each to ``writer`` in order.

    Returns the skipped episodes, stem -> ``"<code>: <reason>"``.

    Raises:
        StorageError: a worker could not write an episode's frames (full or read-only disk).
    """
    skipped: dict[str, str] = {}
    for done, result in enumerate(_aligned_in_order(jobs, n_workers), 1):
        stem = result["stem"]
        if not result["ok"] and result["code"] == "storage":  # a full or read-only disk stops the export
            raise storage_error(OSError(result["errno"], result["reason"]), out_dir, f"writing the frames of {stem}")
        if result["ok"]:
            a, b = result["rgb_rows"]
            rgb_path = Path(result["rgb_path"])
            frames = np.load(rgb_path, mmap_mode="r")[a:b]
            writer.add_episode(
                result["state"], {CAMERA_KEY: frames}, result["timestamps_s"], stem,
                record={"files": files[stem], "alignment": result["report"]},
            )
            del frames
            rgb_path.unlink()
        else:
            skipped[stem] = f"{result['code']}: {result['reason']}"
        if progress is not None:
            progress(stem, done, len(jobs))
    return skipped
