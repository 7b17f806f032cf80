"""Conversion: a pairing manifest in, ``dataset.npz`` with its ``dataset.json`` sidecar and ``norm_stats.json`` out.

Runs the alignment jobs and appends each episode's frames to one uncompressed npz as soon as it
and every episode before it are aligned (:class:`~dpflow_core.replay_buffer.writer.NpzStreamWriter`),
then writes the rest, hashes it, computes norm stats and installs the three files; gives a
:class:`ConversionResult` (paths, SHA-256, size in bytes, frequency in Hz, counts).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dpflow_core.conversion.align import (
    DEFAULT_MAX_GAP_S, DEFAULT_MIN_SEGMENT_FRAMES, GAP_POLICIES, INVALID_POSE_POLICIES, LOWDIM_KEYS,
    LOWDIM_WIDTH, check_image_size,
)
from dpflow_core.conversion.inputs import (
    conversion_options, options_key, inputs_topic_map, load_inputs, norm_stats_path_for, sidecar_path_for,
)
from dpflow_core.conversion.install import backup_name, install_output, remove_stale, write_json_atomic
from dpflow_core.conversion.jobs import FrameStreamer, align_all, alignment_job
from dpflow_core.conversion.metadata import dataset_metadata
from dpflow_core.conversion.rates import RATE_POLICIES, apply_rate_policy, group_path, subset_manifest
from dpflow_core.episode_cache import EpisodeCache, resolve_cache
from dpflow_core.errors import ConversionError, DatasetError, storage_error
from dpflow_core.files import fsync_dir, os_errors_named, temp_name
from dpflow_core.replay_buffer.writer import FRAMES_MEMBER, NpzMember, NpzStreamWriter, npy_data_offset
from dpflow_core.recordings.topics import TopicMap
from dpflow_core.results import StageResult


# --------------------------------------------------------------------------- convert


#: Metadata of one conversion run rather than of the dataset: kept in the sidecar, left out of
#: ``meta__info_json`` so that the dataset's bytes (and SHA-256) depend on its input and options only.
RUN_ONLY_KEYS = ("created_at", "workers", "timings_s", "wall_time_s", "stale_files_removed", "cache")
#: The same, per episode entry of ``episodes``.
RUN_ONLY_EPISODE_KEYS = ("convert_seconds", "worker_peak_rss_mb", "cached")


def _hashed_metadata(meta: dict) -> dict:
    """``meta`` without :data:`RUN_ONLY_KEYS` (and :data:`RUN_ONLY_EPISODE_KEYS` per episode): the member's copy."""
    doc = {k: v for k, v in meta.items() if k not in RUN_ONLY_KEYS}
    doc["episodes"] = [{k: v for k, v in e.items() if k not in RUN_ONLY_EPISODE_KEYS} for e in meta["episodes"]]
    return doc


@dataclass(frozen=True)
class ConversionResult(StageResult):
    """What :func:`convert` produced; the value of the ``dataset_npz`` asset.

    Attributes:
        path: the ``dataset.npz``.
        sha256: SHA-256 (hex) of ``path``, computed while writing.
        size_bytes: size of ``path`` in bytes.
        sidecar_path: the metadata JSON beside it (``dataset.json``).
        norm_stats_path: the ``norm_stats.json`` beside it.
        frequency_hz: measured dataset frequency (1 / median frame interval), Hz.
        n_episodes: episodes in the dataset; total_steps: T, frames of all episodes.
        image_size: (W, H) pixels.
        rejected: episodes left out, with stage, code and reason.
        wall_time_s: seconds the conversion took.
        metadata: the metadata document (as in the sidecar).
        reused: True when an identical existing dataset was returned instead.

    ``to_dict``/``from_dict`` (:class:`~dpflow_core.results.StageResult`): ``from_dict`` needs the
    nine fields from ``path`` to ``image_size`` (what ``dataset_npz`` stored before its value was
    typed); the last four then take their defaults. Equality compares those nine, the dataset,
    not the run that converted or reused it.
    """

    path: Path
    sha256: str
    size_bytes: int
    sidecar_path: Path
    norm_stats_path: Path
    frequency_hz: float
    n_episodes: int
    total_steps: int
    image_size: tuple[int, int]
    rejected: list[dict] = field(default_factory=list, compare=False)
    wall_time_s: float = field(default=0.0, compare=False)
    metadata: dict = field(default_factory=dict, compare=False, repr=False)
    reused: bool = field(default=False, compare=False)

    @property
    def frames_per_s(self) -> float:
        """Converted frames per second of wall time."""
        return self.total_steps / self.wall_time_s if self.wall_time_s > 0 else float("nan")


def _result_from_sidecar(out: Path, sidecar: Path, norm: Path, meta: dict, reused: bool) -> ConversionResult:
    return ConversionResult(
        path=out,
        sha256=meta["sha256"],
        size_bytes=int(meta["size_bytes"]),
        sidecar_path=sidecar,
        norm_stats_path=norm,
        frequency_hz=float(meta["frequency_hz"]),
        n_episodes=int(meta["n_episodes"]),
        total_steps=int(meta["total_steps"]),
        image_size=tuple(meta["image_size"]),
        rejected=list(meta.get("rejected", [])),
        wall_time_s=float(meta.get("wall_time_s", 0.0)),
        metadata=meta,
        reused=reused,
    )


def _reject_reasons(rejected: list[dict], limit: int = 20) -> str:
    parts = [f"{r['stem']}: {r['reason']}" for r in rejected[:limit]]
    if len(rejected) > limit:
        parts.append(f"... {len(rejected) - limit} more")
    return "; ".join(parts)


def convert(
    manifest_or_paths: Any,
    out_path: str | Path,
    image_size: tuple[int, int] = (224, 224),
    workers: int = 0,
    backup: bool = False,
    invalid_pose_policy: str = "trim",
    min_overlap_fraction: float = 0.5,
    frequency_tolerance: float = 0.05,
    topics: TopicMap | None = None,
    verify_sha256: bool = True,
    reuse_existing: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    max_gap_s: float = DEFAULT_MAX_GAP_S,
    gap_policy: str = "split",
    min_segment_frames: int = DEFAULT_MIN_SEGMENT_FRAMES,
    min_pose_score: float = 0.0,
    cache: "EpisodeCache | str | Path | bool | None" = True,
    plausibility: Any = None,
    short_episode_policy: str = "reject",
    rate_policy: str = "resample",
) -> ConversionResult:
    """Convert the accepted episodes of a pairing manifest into one ``dataset.npz``.

    Each episode goes through :func:`align_episode` in a worker process and is written to temporary ``.npy``
    files beside the output (or into the cache); the parent appends its frames, in manifest order, to an
    uncompressed zip (formats.md section 2 members, ``data__camera0_rgb`` first) as soon as it and every episode
    before it are aligned, while later ones are still aligning; once all are, it writes the other members (plus
    ``meta__info_json``: the metadata as 1-D uint8 JSON) and the frames' headers, and hashes the file (SHA-256).
    An episode whose frames were appended but that is rejected afterwards (its frequency, known against all
    episodes' median) is cut out of the file again. Memory stays bounded by one episode per worker. The dataset
    frequency is 1 / the median frame interval over all episodes; an episode whose own frequency differs from
    the task's (the largest group of episodes agreeing within ``frequency_tolerance``, relative) is resampled
    to it, converted as a dataset of its own or rejected, by ``rate_policy``
    (:mod:`~dpflow_core.conversion.rates`).

    Metadata (the same document in ``meta__info_json`` and in the sidecar): episode count, total steps, episode
    lengths (min/mean/max) and per-episode reports (length, frequency, trimmed seconds, gaps, pose-invalid
    handling, the camera's and IMU's offsets), measured frequency, image size, member shapes and dtypes, value
    ranges, the input manifest (stems and file SHA-256), rejected episodes with reasons, options, converter
    version, ``dataset_key`` and ``offsets`` (the task's offset figures, flags and latency recommendation,
    :func:`~dpflow_core.offsets.task_offsets`). Values known only once the file is complete (``sha256``,
    ``size_bytes``) are null in the member and filled in the sidecar. What differs between two runs on the same
    input (:data:`RUN_ONLY_KEYS`: creation time, workers, timings, stale files removed, and per episode
    :data:`RUN_ONLY_EPISODE_KEYS`) is in the sidecar only, never in the member, so converting the same manifest
    with the same options twice gives a byte-identical ``dataset.npz`` (the zip times are fixed as well).

    Args:
        manifest_or_paths: see :func:`load_inputs` (manifest, dict, path, task folder, or a list).
        out_path: the ``.npz`` to create. ``dataset.json`` (metadata) and
            ``norm_stats.json`` (:func:`dpflow_core.dataset.compute_norm_stats`)
            are written beside it (:func:`sidecar_path_for`, :func:`norm_stats_path_for`).
        image_size: (W, H) pixels of ``data__camera0_rgb``.
        workers: worker processes; 0 = :func:`~dpflow_core.conversion.jobs.default_workers` (the
            free cores), never more than the episodes to align.
        backup: when the output exists, keep it as ``<stem>.bak-<UTC time><suffix>``
            (hard link) and replace it atomically; otherwise an existing output is an error.
        invalid_pose_policy, min_overlap_fraction: see :func:`align_episode`.
        topics: topic names; default: the manifest's ``topics``, else the DAS defaults.
        frequency_tolerance: relative tolerance of an episode's frequency.
        verify_sha256: hash each input and compare with the manifest before converting.
        reuse_existing: when the output exists and its sidecar records the same
            :func:`dataset_key` and file size, return it (``reused=True``) instead of failing.
        progress: called as ``progress(stage, done, total)`` with stage
            ``"episodes"`` (episodes aligned) or ``"write"`` (bytes written).
        max_gap_s, gap_policy, min_segment_frames: camera holes longer than ``max_gap_s``
            seconds are never bridged: ``"split"`` (default) stores the pieces of at least
            ``min_segment_frames`` frames as separate episodes, ``"reject"`` rejects the
            episode (``camera_gap``); see :func:`align_episode`. Every gap and what was done
            is in the metadata (``episodes[].long_gaps``, ``episodes[].segment``).
        min_pose_score: poses with a VIO ``score`` below this count as invalid too.
        cache: the per-episode cache (:class:`~dpflow_core.episode_cache.EpisodeCache`):
            True (default) uses :func:`~dpflow_core.episode_cache.default_cache_dir` with its
            size limit, a path or an ``EpisodeCache`` another one, False or None none. An episode
            whose input SHA-256, stem and alignment options are cached is not aligned again; the
            dataset is byte-identical either way (``cache`` and ``episodes[].cached`` in the
            sidecar say what was reused). The cache is pruned to its limit after the conversion.
        plausibility: thresholds and policies of the pose and gripper rules (a
            :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions` or a dict; None: the
            defaults, docs/formats.md); findings in ``episodes[].plausibility``.
        rate_policy: an episode at another rate than the task's: ``"resample"`` (default) onto the task's
            grid (images held, poses interpolated; ``episodes[].resampled``, warning ``rate_resampled``;
            placed after the others), ``"group"`` each rate group as its own dataset beside the output
            (``<stem>-<rate>hz.npz``, listed in ``rate_groups``; written before the output, so a failure
            of the output leaves them), ``"reject"`` (``frequency_mismatch``).
        short_episode_policy: an episode or piece under ``min_segment_frames`` frames is rejected
            (``"reject"``: a piece is dropped and listed) or kept with a warning (``"warn"``).

    Returns:
        The output paths, hash and figures.

    Raises:
        ConversionError: the output (or its sidecar / norm stats) exists
            (``output_exists``); no episode survived (``no_valid_episodes``: "no
            valid episodes: N found, N rejected: reasons"); a bad option or manifest.
        PairingError: a manifest file is missing or malformed, or a task folder cannot be paired.
        DatasetError: the written dataset fails validation or its norm stats
            cannot be computed (zero-variance dimension, non-finite values); the
            output is then not created.
        StorageError: the output folder cannot be created or written (disk full, permission denied, read-only
            file system), naming the output; nothing of this call is left there.
    """
    started = time.perf_counter()
    image_size = check_image_size(image_size)
    episode_cache = resolve_cache(cache)
    if invalid_pose_policy not in INVALID_POSE_POLICIES:
        raise ConversionError(
            f"invalid_pose_policy must be one of {INVALID_POSE_POLICIES}, got {invalid_pose_policy!r}", code="bad_option"
        )
    if gap_policy not in GAP_POLICIES:
        raise ConversionError(f"gap_policy must be one of {GAP_POLICIES}, got {gap_policy!r}", code="bad_option")
    if not 0 < frequency_tolerance < 1:
        raise ConversionError(f"frequency_tolerance must be in (0, 1), got {frequency_tolerance}", code="bad_option")
    if rate_policy not in RATE_POLICIES:
        raise ConversionError(f"rate_policy must be one of {RATE_POLICIES}, got {rate_policy!r}", code="bad_option")
    # What a rate group's own dataset is converted with: everything but the inputs, output and rate policy.
    same_options = dict(image_size=image_size, workers=workers, backup=backup, invalid_pose_policy=invalid_pose_policy,
                        min_overlap_fraction=min_overlap_fraction, frequency_tolerance=frequency_tolerance,
                        topics=topics, verify_sha256=verify_sha256, reuse_existing=reuse_existing, max_gap_s=max_gap_s,
                        gap_policy=gap_policy, min_segment_frames=min_segment_frames, min_pose_score=min_pose_score,
                        plausibility=plausibility, short_episode_policy=short_episode_policy)
    out = Path(out_path).absolute()
    if out.suffix != ".npz":
        raise ConversionError("output must end in .npz", out, code="bad_option")
    folder = out.parent
    sidecar, norm_path = sidecar_path_for(out), norm_stats_path_for(out)
    inputs = load_inputs(manifest_or_paths)
    topics = same_options["topics"] = topics or inputs_topic_map(inputs)
    options = conversion_options(image_size, invalid_pose_policy, min_overlap_fraction, frequency_tolerance, topics,
                                  max_gap_s, gap_policy, min_segment_frames, plausibility, short_episode_policy,
                                  rate_policy)
    if min_pose_score:
        options["min_pose_score"] = min_pose_score
    checks = options["content_checks"]
    key = options_key(inputs, options)

    existing = [p for p in (out, sidecar, norm_path) if p.exists()]
    if existing and reuse_existing and out.exists() and sidecar.exists() and norm_path.exists():
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConversionError(f"existing sidecar is unreadable: {exc}", sidecar, code="output_exists") from exc
        if meta.get("dataset_key") == key and meta.get("size_bytes") == out.stat().st_size:
            return _result_from_sidecar(out, sidecar, norm_path, meta, reused=True)
        raise ConversionError(
            "output exists and is a different dataset (its sidecar records another input/option key or size)",
            out,
            code="output_exists",
        )
    if existing and not backup:
        raise ConversionError(
            f"refusing to overwrite existing {', '.join(p.name for p in existing)}; choose another path or pass --backup",
            out,
            code="output_exists",
        )
    n_found = len(inputs.episodes) + len(inputs.rejected)
    if not inputs.episodes:
        raise ConversionError(
            f"no valid episodes: {n_found} found, {len(inputs.rejected)} rejected: {_reject_reasons(inputs.rejected)}",
            inputs.manifests[0] if inputs.manifests else None,
            code="no_valid_episodes",
        )

    with os_errors_named(folder, "creating the output folder"):
        folder.mkdir(parents=True, exist_ok=True)
    stale = remove_stale(folder)
    partial = folder / temp_name(out.name, "partial", unique=False)
    work = folder / temp_name(out.name, "work", unique=False)
    made: list[Path] = []
    streamer: FrameStreamer | None = None
    frames_out: NpzStreamWriter | None = None
    try:
        work.mkdir()
        jobs = [
            alignment_job(e, image_size, topics, invalid_pose_policy, min_overlap_fraction, verify_sha256,
                          max_gap_s, gap_policy, min_segment_frames, min_pose_score, checks)
            | {"dir": str(work / f"{i:06d}")}
            for i, e in enumerate(inputs.episodes)
        ]
        w, h = image_size
        made.append(partial)  # named after this process: only this call can have made it
        frames_out = NpzStreamWriter(partial, (h, w, 3))
        streamer = FrameStreamer(frames_out)
        t_jobs = time.perf_counter()
        results, n_workers = align_all(jobs, episode_cache, workers, progress, streamer.offer)
        timings = {"episodes": round(time.perf_counter() - t_jobs, 3)}
        t_write = time.perf_counter()
        streamer.close()
        rejected = list(inputs.rejected)
        ok = []
        for i, r in enumerate(results):
            if not r["ok"] and r["code"] == "storage":  # a full or read-only disk stops the run
                raise storage_error(OSError(r["errno"], r["reason"]), out, f"writing the scratch files of {r['stem']}")
            if r["ok"]:
                ok.append((i, r))
            else:
                rejected.append({"stem": r["stem"], "stage": "conversion", "path": r["path"], "code": r["code"],
                                 "reason": r["reason"]})

        rate_group_info = []
        if ok:
            ok, off_rate, aside = apply_rate_policy(ok, rate_policy, frequency_tolerance, frames_out, work)
            rejected.extend(off_rate)
            for hz, stems in aside:  # before the main dataset: its metadata names what they became
                g = convert(subset_manifest(inputs, stems), group_path(out, hz), rate_policy="reject", **{
                    **same_options, "cache": episode_cache if episode_cache is not None else False})
                rate_group_info.append({"frequency_hz": g.frequency_hz, "path": str(g.path), "sha256": g.sha256,
                                        "n_episodes": g.n_episodes, "episodes": stems})
        if not ok:
            raise ConversionError(
                f"no valid episodes: {n_found} found, {len(rejected)} rejected: {_reject_reasons(rejected)}",
                inputs.manifests[0] if inputs.manifests else None,
                code="no_valid_episodes",
            )

        dts = np.concatenate([np.diff(np.load(r["files"]["timestamp"])) for r in ok])
        frequency_hz = float(1.0 / np.median(dts))
        lengths = np.array([r["n"] for r in ok], dtype=np.int64)
        episode_ends = np.cumsum(lengths).astype(np.int64)
        total = int(episode_ends[-1])

        members = [NpzMember("meta__episode_ends", episode_ends.shape, np.dtype(np.int64), data=episode_ends.tobytes())]
        for k in ("timestamp", *LOWDIM_KEYS):
            dtype = np.dtype(np.float64 if k == "timestamp" else np.float32)
            shape = (total,) if k == "timestamp" else (total, LOWDIM_WIDTH[k])
            pieces = []
            for r in ok:
                f_ = r["files"][k]
                pieces.append((f_, npy_data_offset(f_), r["n"] * dtype.itemsize * (1 if k == "timestamp" else LOWDIM_WIDTH[k]), False))
            members.append(NpzMember("data__" + k, shape, dtype, pieces))
        # Its frames are in the file already; this entry describes the member for the metadata.
        frames_member = NpzMember(FRAMES_MEMBER, (total, h, w, 3), np.dtype(np.uint8))

        stamp = datetime.now(timezone.utc)
        meta = dataset_metadata(inputs, ok, rejected, options, key, frequency_hz, lengths, image_size,
                         [frames_member, *members], stamp, stale)
        meta["workers"] = n_workers
        meta["rate_groups"] = rate_group_info
        n_cached = len({r["stem"] for r in ok if r["cached"]})
        meta["cache"] = {"dir": str(episode_cache.root) if episode_cache else None,
                         "episodes_reused": n_cached, "episodes_aligned": len(jobs) - n_cached}
        for r in ok:
            if r["report"].get("resampled"):
                rs = r["report"]["resampled"]
                meta["warnings"].append({"stem": r["stem"], "code": "rate_resampled", "reason": (
                    f"measured {rs['from_hz']:.3f} Hz, resampled to the dataset's {rs['to_hz']:.3f} Hz "
                    f"({rs['frames_before']} -> {rs['frames_after']} frames, images held, poses interpolated)")})
            for w in r["report"].get("short_episode") or []:
                meta["warnings"].append({"stem": r["stem"], **w})
            for f in (r["report"].get("plausibility") or {}).get("findings", []):
                if f["action"] == "warned":
                    meta["warnings"].append({"stem": r["stem"], "code": f["code"], "reason": f["reason"]})
        if len(ok) == 1:
            meta["warnings"].append({
                "code": "single_episode",
                "reason": "the dataset holds one episode: the train/val split is by episode, so training has no "
                          "validation episode and the evaluation needs held-out episodes from another dataset; "
                          "demo start/end pose statistics are constant (constant_dims in norm_stats.json)",
            })
        meta["timings_s"] = dict(timings)
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        info = json.dumps(_hashed_metadata(meta)).encode()
        members.append(NpzMember("meta__info_json", (len(info),), np.dtype(np.uint8), data=info))

        sha256, size = frames_out.finish([t for r in ok for t in r["tags"]], members, total, progress)
        shutil.rmtree(work, ignore_errors=True)
        timings["write"] = round(time.perf_counter() - t_write, 3)

        from dpflow_core.dataset import compute_norm_stats, origin_start_keys

        t_stats = time.perf_counter()
        # One episode: start and end pose constant by construction; a start pose at the VIO origin in every
        # episode too (origin_start_keys); a start pose constant elsewhere (one take twice) still fails.
        constant_ok = ("robot0_demo_start_pose", "robot0_demo_end_pose") if len(ok) == 1 else origin_start_keys(partial)
        try:
            stats = compute_norm_stats(partial, sha256=sha256, allow_zero_variance=constant_ok)
        except DatasetError as exc:
            # Name the output and the episodes, never the hidden temporary file.
            stems = ", ".join(dict.fromkeys(r["stem"] for r in ok))
            raise DatasetError(f"norm stats of the converted episodes ({stems}) failed: {exc.reason}; "
                               f"{out.name} was not written", out, code=exc.code) from exc
        timings["norm_stats"] = round(time.perf_counter() - t_stats, 3)
        meta["timings_s"] = {**timings, "total": round(time.perf_counter() - started, 3)}
        meta["sha256"], meta["size_bytes"] = sha256, size
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        norm_tmp = write_json_atomic(norm_path, stats)
        made.append(norm_tmp)
        side_tmp = write_json_atomic(sidecar, meta)
        made.append(side_tmp)

        suffix = stamp.strftime("%Y%m%dT%H%M%SZ")
        # The npz goes last: when it exists, its sidecar and norm stats exist too.
        for tmp, final in ((norm_tmp, norm_path), (side_tmp, sidecar), (partial, out)):
            install_output(tmp, final, backup_name(final, suffix) if backup else None)
            made.remove(tmp)
            if not backup and final is not out:
                made.append(final)
        fsync_dir(folder)
        made.clear()
        if episode_cache is not None:
            try:
                episode_cache.prune()
            except OSError:
                pass  # a cache that cannot be pruned now is pruned by the next conversion or `dpflow cache prune`
    except OSError as exc:
        if exc.errno is None:
            raise
        # The disk filled or the folder became unwritable: the output is named, the finally removes what was made.
        raise storage_error(exc, out, "writing the dataset") from exc
    finally:
        if streamer is not None:
            streamer.cancel()
        if frames_out is not None:
            frames_out.close()
        for p in made:
            # Reached only on failure: remove what this call created, never a pre-existing output.
            p.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return _result_from_sidecar(out, sidecar, norm_path, meta, reused=False)
