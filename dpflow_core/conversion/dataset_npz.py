"""Conversion: a pairing manifest in, ``dataset.npz`` with its ``dataset.json`` sidecar and ``norm_stats.json`` out.

Runs the alignment jobs and appends each episode's frames to one uncompressed npz as soon as it
and every episode before it are aligned (:class:`~dpflow_core.replay_buffer.writer.NpzStreamWriter`),
then writes the rest, hashes it, computes norm stats and installs the three files; gives a
:class:`ConversionResult` (paths, SHA-256, size in bytes, frequency in Hz, counts).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dpflow_core.conversion.align import LOWDIM_KEYS, LOWDIM_WIDTH
from dpflow_core.conversion.inputs import (
    ConversionInputs, inputs_topic_map, load_inputs, norm_stats_path_for, options_key, sidecar_path_for,
)
from dpflow_core.conversion.install import backup_name, install_output, remove_stale, write_json_atomic
from dpflow_core.conversion.jobs import FrameStreamer, align_all, alignment_job
from dpflow_core.conversion.metadata import dataset_metadata
from dpflow_core.conversion.rates import apply_rate_policy, group_path, subset_inputs
from dpflow_core.conversion.settings import ConversionSettings, check_image_size
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
    settings: ConversionSettings | None = None,
    *,
    workers: int = 0,
    backup: bool = False,
    verify_sha256: bool = True,
    reuse_existing: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    cache: "EpisodeCache | str | Path | bool | None" = True,
    mixed_tasks: bool = False,
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
    with the same settings twice gives a byte-identical ``dataset.npz`` (the zip times are fixed as well).

    Args:
        manifest_or_paths: see :func:`load_inputs` (manifest, dict, path, task folder, or a list). The
            recordings' topic names are the manifest's ``topics``, else the DAS defaults.
        out_path: the ``.npz`` to create. ``dataset.json`` (metadata) and
            ``norm_stats.json`` (:func:`dpflow_core.dataset.compute_norm_stats`)
            are written beside it (:func:`sidecar_path_for`, :func:`norm_stats_path_for`).
        settings: what decides the dataset's content (:class:`ConversionSettings`, default its defaults):
            ``image_size`` (W, H) pixels of ``data__camera0_rgb`` (required here); ``invalid_pose_policy``,
            ``min_overlap_fraction``, ``min_pose_score`` (see :func:`align_episode`); camera holes longer than
            ``max_gap_s`` seconds are never bridged: ``gap_policy="split"`` stores the pieces as separate
            episodes, ``"reject"`` rejects the episode (``camera_gap``; every gap and what was done in
            ``episodes[].long_gaps`` and ``episodes[].segment``); an episode or piece under
            ``min_segment_frames`` frames is rejected (``short_episode_policy="reject"``: a piece is dropped
            and listed) or kept with a warning (``"warn"``); the ``plausibility`` findings are in
            ``episodes[].plausibility``; an episode at another rate than the task's is ``rate_policy``
            ``"resample"``: resampled onto the task's grid (images held, poses interpolated;
            ``episodes[].resampled``, warning ``rate_resampled``; placed after the others), ``"group"``: each
            rate group converted as its own dataset beside the output (``<stem>-<rate>hz.npz``, listed in
            ``rate_groups``; written before the output, so a failure of the output leaves them), or
            ``"reject"`` (``frequency_mismatch``).
        workers: worker processes; 0 = :func:`~dpflow_core.conversion.jobs.default_workers` (the
            free cores), never more than the episodes to align.
        backup: when the output exists, keep it as ``<stem>.bak-<UTC time><suffix>``
            (hard link) and replace it atomically; otherwise an existing output is an error.
        verify_sha256: hash each input and compare with the manifest before converting.
        reuse_existing: when the output exists and its sidecar records the same
            :func:`dataset_key` and file size, return it (``reused=True``) instead of failing.
        progress: called as ``progress(stage, done, total)`` with stage
            ``"episodes"`` (episodes aligned) or ``"write"`` (bytes written).
        cache: the per-episode cache (:class:`~dpflow_core.episode_cache.EpisodeCache`):
            True (default) uses :func:`~dpflow_core.episode_cache.default_cache_dir` with its
            size limit, a path or an ``EpisodeCache`` another one, False or None none. An episode
            whose input SHA-256, stem and alignment settings are cached is not aligned again; the
            dataset is byte-identical either way (``cache`` and ``episodes[].cached`` in the
            sidecar say what was reused). The cache is pruned to its limit after the conversion.
        mixed_tasks: accept manifests of different tasks (:func:`load_inputs`; refused by default).

    Returns:
        The output paths, hash and figures.

    Raises:
        ConversionError: the output (or its sidecar / norm stats) exists
            (``output_exists``); no episode survived (``no_valid_episodes``: "no
            valid episodes: N found, N rejected: reasons"); no image size or a bad output name
            (``bad_option``; a bad setting is refused when the settings are built); a bad manifest; manifests of
            different tasks without ``mixed_tasks`` (``mixed_tasks``).
        PairingError: a manifest file is missing or malformed, or a task folder cannot be paired.
        DatasetError: the written dataset fails validation or its norm stats
            cannot be computed (zero-variance dimension, non-finite values); the
            output is then not created.
        StorageError: the output folder cannot be created or written (disk full, permission denied, read-only
            file system), naming the output; nothing of this call is left there.
    """
    started = time.perf_counter()
    settings = settings or ConversionSettings()
    check_image_size(settings.image_size)
    episode_cache = resolve_cache(cache)
    out = Path(out_path).absolute()
    if out.suffix != ".npz":
        raise ConversionError("output must end in .npz", out, code="bad_option")
    inputs = load_inputs(manifest_or_paths, mixed_tasks=mixed_tasks)
    topics = inputs_topic_map(inputs)
    options = settings.options(topics)
    key = options_key(inputs, options)
    existing = _existing_output(out, key, reuse_existing, backup)
    if existing is not None:
        return existing
    if not inputs.episodes:
        raise _no_valid_episodes(inputs, inputs.rejected)

    with os_errors_named(out.parent, "creating the output folder"):
        out.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale(out.parent)
    run = _Conversion(out, inputs, settings, options, key, episode_cache, progress, topics,
                      {"workers": workers, "backup": backup, "verify_sha256": verify_sha256,
                       "reuse_existing": reuse_existing})
    try:
        meta = run.write(stale, started)
    except OSError as exc:
        if exc.errno is None:
            raise
        # The disk filled or the folder became unwritable: the output is named, the cleanup removes what was made.
        raise storage_error(exc, out, "writing the dataset") from exc
    finally:
        run.cleanup()
    return _result_from_sidecar(out, sidecar_path_for(out), norm_stats_path_for(out), meta, reused=False)


def _no_valid_episodes(inputs: ConversionInputs, rejected: list[dict]) -> ConversionError:
    n_found = len(inputs.episodes) + len(inputs.rejected)
    return ConversionError(
        f"no valid episodes: {n_found} found, {len(rejected)} rejected: {_reject_reasons(rejected)}",
        inputs.manifests[0] if inputs.manifests else None,
        code="no_valid_episodes",
    )


def _existing_output(out: Path, key: str, reuse_existing: bool, backup: bool) -> ConversionResult | None:
    """The existing dataset at ``out`` when it may be reused (same ``key`` and size), None when ``out`` and its
    sidecar and norm stats are free or may be replaced (``backup``).

    Raises:
        ConversionError: ``output_exists`` when one of them exists and may be neither reused nor replaced.
    """
    sidecar, norm_path = sidecar_path_for(out), norm_stats_path_for(out)
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
    return None


class _Conversion:
    """One conversion under way (:func:`convert`): its output, inputs, settings (and ``options``, their recorded
    form), dataset ``key``, cache, progress callback, the recordings' ``topics`` and ``run`` options
    (``workers``, ``backup``, ``verify_sha256``, ``reuse_existing``); and what it has made beside the output,
    which :meth:`cleanup` removes unless it was installed."""

    def __init__(self, out: Path, inputs: ConversionInputs, settings: ConversionSettings, options: dict, key: str,
                 episode_cache: EpisodeCache | None, progress: Callable | None, topics: TopicMap, run: dict):
        self.out, self.inputs, self.settings, self.options, self.key = out, inputs, settings, options, key
        self.episode_cache, self.progress, self.topics, self.run = episode_cache, progress, topics, run
        self.t_write = 0.0
        self.partial = out.parent / temp_name(out.name, "partial", unique=False)
        self.work = out.parent / temp_name(out.name, "work", unique=False)
        self.made: list[Path] = []
        self.streamer: FrameStreamer | None = None
        self.frames_out: NpzStreamWriter | None = None

    def write(self, stale: list[str], started: float) -> dict:
        """Align, write, hash and install the dataset; its metadata document (as in the sidecar)."""
        ok, rejected, n_jobs, n_workers, timings = self.align()
        ok, rate_group_info = self.sort_rates(ok, rejected)
        frequency_hz, total, members, frames_member = _members(ok, self.settings.image_size)
        stamp = datetime.now(timezone.utc)
        meta = dataset_metadata(self.inputs, ok, rejected, self.options, self.key, frequency_hz,
                                [frames_member, *members], stamp, stale)
        meta["workers"] = n_workers
        meta["rate_groups"] = rate_group_info
        n_cached = len({r["stem"] for r in ok if r["cached"]})
        meta["cache"] = {"dir": str(self.episode_cache.root) if self.episode_cache else None,
                         "episodes_reused": n_cached, "episodes_aligned": n_jobs - n_cached}
        meta["warnings"].extend(_part_warnings(ok))
        meta["timings_s"] = dict(timings)
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        info = json.dumps(_hashed_metadata(meta)).encode()
        members.append(NpzMember("meta__info_json", (len(info),), np.dtype(np.uint8), data=info))

        sha256, size = self.frames_out.finish([t for r in ok for t in r["tags"]], members, total, self.progress)
        shutil.rmtree(self.work, ignore_errors=True)
        timings["write"] = round(time.perf_counter() - self.t_write, 3)
        t_stats = time.perf_counter()
        stats = self.norm_stats(ok, sha256)
        timings["norm_stats"] = round(time.perf_counter() - t_stats, 3)
        meta["timings_s"] = {**timings, "total": round(time.perf_counter() - started, 3)}
        meta["sha256"], meta["size_bytes"] = sha256, size
        meta["wall_time_s"] = round(time.perf_counter() - started, 3)
        self.install(stats, meta, stamp)
        return meta

    def align(self) -> tuple[list[tuple[int, dict]], list[dict], int, int, dict]:
        """Align every episode (from the cache where it holds them) while their frames are appended to the
        partial npz: the (index, summary) of those aligned, the rejected ones (the pairing's first), the number
        of jobs and of worker processes, and the timings so far.

        Raises:
            StorageError: a worker could not write its scratch files (the disk is full or read-only).
        """
        self.work.mkdir()
        jobs = [
            alignment_job(e, self.settings, self.topics, self.run["verify_sha256"])
            | {"dir": str(self.work / f"{i:06d}")}
            for i, e in enumerate(self.inputs.episodes)
        ]
        w, h = self.settings.image_size
        self.made.append(self.partial)  # named after this process: only this call can have made it
        self.frames_out = NpzStreamWriter(self.partial, (h, w, 3))
        self.streamer = FrameStreamer(self.frames_out)
        t_jobs = time.perf_counter()
        results, n_workers = align_all(jobs, self.episode_cache, self.run["workers"], self.progress, self.streamer.offer)
        timings = {"episodes": round(time.perf_counter() - t_jobs, 3)}
        self.t_write = time.perf_counter()
        self.streamer.close()
        rejected = list(self.inputs.rejected)
        ok = []
        for i, r in enumerate(results):
            if not r["ok"] and r["code"] == "storage":  # a full or read-only disk stops the run
                raise storage_error(OSError(r["errno"], r["reason"]), self.out, f"writing the scratch files of {r['stem']}")
            if r["ok"]:
                ok.append((i, r))
            else:
                rejected.append({"stem": r["stem"], "stage": "conversion", "path": r["path"], "code": r["code"],
                                 "reason": r["reason"]})
        return ok, rejected, len(jobs), n_workers, timings

    def sort_rates(self, ok: list[tuple[int, dict]], rejected: list[dict]) -> tuple[list[dict], list[dict]]:
        """The parts to write by ``rate_policy`` (:func:`~dpflow_core.conversion.rates.apply_rate_policy`; the
        off-rate ones added to ``rejected``) and the rate groups converted as datasets of their own.

        Raises:
            ConversionError: ``no_valid_episodes`` when no part is left.
        """
        rate_group_info = []
        if ok:
            ok, off_rate, aside = apply_rate_policy(ok, self.settings.rate_policy, self.settings.frequency_tolerance,
                                                    self.frames_out, self.work)
            rejected.extend(off_rate)
            for hz, stems in aside:  # before the main dataset: its metadata names what they became
                g = convert(subset_inputs(self.inputs, stems), group_path(self.out, hz),
                            dataclasses.replace(self.settings, rate_policy="reject"), **self.run,
                            cache=self.episode_cache if self.episode_cache is not None else False)
                rate_group_info.append({"frequency_hz": g.frequency_hz, "path": str(g.path), "sha256": g.sha256,
                                        "n_episodes": g.n_episodes, "episodes": stems})
        if not ok:
            raise _no_valid_episodes(self.inputs, rejected)
        return ok, rate_group_info

    def norm_stats(self, ok: list[dict], sha256: str) -> dict:
        """The norm stats of the partial npz (:func:`~dpflow_core.dataset.compute_norm_stats`).

        Raises:
            DatasetError: they cannot be computed, naming the output and the episodes.
        """
        from dpflow_core.dataset import compute_norm_stats, origin_start_keys

        # One episode: start and end pose constant by construction; a start pose at the VIO origin in every
        # episode too (origin_start_keys); a start pose constant elsewhere (one take twice) still fails.
        constant_ok = ("robot0_demo_start_pose", "robot0_demo_end_pose") if len(ok) == 1 else origin_start_keys(self.partial)
        try:
            return compute_norm_stats(self.partial, sha256=sha256, allow_zero_variance=constant_ok)
        except DatasetError as exc:
            # Name the output and the episodes, never the hidden temporary file.
            stems = ", ".join(dict.fromkeys(r["stem"] for r in ok))
            raise DatasetError(f"norm stats of the converted episodes ({stems}) failed: {exc.reason}; "
                               f"{self.out.name} was not written", self.out, code=exc.code) from exc

    def install(self, stats: dict, meta: dict, stamp: datetime) -> None:
        """Put the norm stats, the sidecar and the npz (last: when it exists, the other two do) in place, keeping
        backups when asked; then prune the cache."""
        out, backup = self.out, self.run["backup"]
        norm_path, sidecar = norm_stats_path_for(out), sidecar_path_for(out)
        norm_tmp = write_json_atomic(norm_path, stats)
        self.made.append(norm_tmp)
        side_tmp = write_json_atomic(sidecar, meta)
        self.made.append(side_tmp)
        suffix = stamp.strftime("%Y%m%dT%H%M%SZ")
        for tmp, final in ((norm_tmp, norm_path), (side_tmp, sidecar), (self.partial, out)):
            install_output(tmp, final, backup_name(final, suffix) if backup else None)
            self.made.remove(tmp)
            if not backup and final is not out:
                self.made.append(final)
        fsync_dir(out.parent)
        self.made.clear()
        if self.episode_cache is not None:
            try:
                self.episode_cache.prune()
            except OSError:
                pass  # a cache that cannot be pruned now is pruned by the next conversion or `dpflow cache prune`

    def cleanup(self) -> None:
        """Stop the frame copies and remove what this call made and did not install (on success: the scratch
        folder only), never a pre-existing output."""
        if self.streamer is not None:
            self.streamer.cancel()
        if self.frames_out is not None:
            self.frames_out.close()
        for p in self.made:
            p.unlink(missing_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)


def _members(ok: list[dict], image_size: tuple[int, int]) -> tuple[float, int, list[NpzMember], NpzMember]:
    """The dataset's frequency (Hz, 1 / the median frame interval), its T (frames of all parts), the members
    other than the frames (``meta__episode_ends``, ``data__timestamp`` and the low-dimensional ones, each
    joined from the parts' ``.npy`` files) and the frames' member (written already; it describes them)."""
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
    w, h = image_size
    return frequency_hz, total, members, NpzMember(FRAMES_MEMBER, (total, h, w, 3), np.dtype(np.uint8))


def _part_warnings(ok: list[dict]) -> list[dict]:
    """The warnings of the kept parts: resampled, short (under ``short_episode_policy="warn"``), warned
    plausibility findings; and ``single_episode`` when there is one."""
    warnings = []
    for r in ok:
        if r["report"].get("resampled"):
            rs = r["report"]["resampled"]
            warnings.append({"stem": r["stem"], "code": "rate_resampled", "reason": (
                f"measured {rs['from_hz']:.3f} Hz, resampled to the dataset's {rs['to_hz']:.3f} Hz "
                f"({rs['frames_before']} -> {rs['frames_after']} frames, images held, poses interpolated)")})
        for w in r["report"].get("short_episode") or []:
            warnings.append({"stem": r["stem"], **w})
        for f in (r["report"].get("plausibility") or {}).get("findings", []):
            if f["action"] == "warned":
                warnings.append({"stem": r["stem"], "code": f["code"], "reason": f["reason"]})
    if len(ok) == 1:
        warnings.append({
            "code": "single_episode",
            "reason": "the dataset holds one episode: the train/val split is by episode, so training has no "
                      "validation episode and the evaluation needs held-out episodes from another dataset; "
                      "demo start/end pose statistics are constant (constant_dims in norm_stats.json)",
        })
    return warnings
