"""The job runner: alignment jobs for worker processes, and their results collected in order.

Takes the accepted episodes and the settings; gives one plain-dict job per episode (picklable), runs
:func:`~dpflow_core.conversion.align.align_episode` on each in a process pool (bounded memory: one
episode per worker) and gives per-episode results: temporary ``.npy`` files, report, peak RSS (MB).
:class:`FrameStreamer` appends the results' frames to the dataset in manifest order as they come.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dpflow_core.conversion.align import ALIGN_IMPORTS, CONVERTER_VERSION, AlignedEpisode, align_episode, split_segments
from dpflow_core.conversion.settings import DEFAULT_MAX_GAP_S, DEFAULT_MIN_SEGMENT_FRAMES, ConversionSettings
from dpflow_core.episode_cache import EpisodeCache, episode_key
from dpflow_core.errors import STORAGE_ERRNOS, ConversionError, DpflowError
from dpflow_core.files import path_kind, pid_alive
from dpflow_core.replay_buffer.writer import NpzStreamWriter, npy_data_offset
from dpflow_core.recordings.topics import TopicMap


#: How a manifest entry that is not pairing's own is explained: a ``manifest_mismatch`` reason ends with it.
EDITED = "the manifest was edited or the file replaced since pairing; pair the task folder again"


# --------------------------------------------------------------------------- workers


def alignment_job(entry: Any, settings: ConversionSettings, topics: TopicMap, verify_sha256: bool) -> dict:
    """The picklable job :func:`align_job_episode` runs in a worker for one accepted episode.

    Args:
        entry: an accepted episode of :func:`~dpflow_core.conversion.inputs.load_inputs` (``stem``,
            ``vio_mcap``, ``size_bytes``, ``sha256``, and ``validation``, whose figures the job carries as
            ``validated``: :func:`validated_figures`).
        settings: the conversion settings; the job holds those that change the aligned arrays, one key
            each (their names, as :func:`~dpflow_core.episode_cache.episode_key` hashes them), and
            ``content_checks`` (:meth:`ConversionSettings.content_checks`). A caller that cannot store
            segments (the LeRobot export) passes ``gap_policy="reject"``: a camera gap longer than
            ``max_gap_s`` seconds is then never bridged.
        topics: the recording's topic names.
        verify_sha256: compare the input's SHA-256 with the manifest's.

    Returns:
        A plain dict (its keys: :func:`settings_of_job` reads them back).
    """
    return {
        "converter_version": CONVERTER_VERSION,
        "max_gap_s": settings.max_gap_s,
        "gap_policy": settings.gap_policy,
        "min_segment_frames": settings.min_segment_frames,
        "min_pose_score": settings.min_pose_score,
        "content_checks": settings.content_checks(),
        "stem": entry.stem,
        "vio_mcap": str(entry.vio_mcap),
        "size_bytes": entry.size_bytes,
        "sha256": entry.sha256,
        "verify_sha256": verify_sha256,
        "image_size": settings.image_size,
        "topics": topics,
        "invalid_pose_policy": settings.invalid_pose_policy,
        "min_overlap_fraction": settings.min_overlap_fraction,
        "validated": validated_figures(entry.validation, topics),
    }


def validated_figures(validation: dict, topics: TopicMap) -> dict:
    """What pairing measured on the ``_vio.mcap`` it validated (a manifest entry's ``validation`` block,
    :class:`~dpflow_core.recordings.RecordingReport`) that alignment measures too while it reads the file:
    ``pose_count`` and ``gripper_count`` (messages with distinct capture times), ``camera_span_ns`` ([first, last]
    camera capture time, int ns). A figure the block lacks (a hand-made entry) is left out and not judged."""
    counts, repeats = validation.get("message_counts") or {}, validation.get("duplicate_timestamps") or {}
    figures: dict[str, Any] = {}
    for name, topic in (("pose_count", topics.pose), ("gripper_count", topics.gripper)):
        if isinstance(counts.get(topic), int):
            figures[name] = counts[topic] - int(repeats.get(topic) or 0)
    first, last = (validation.get(k, {}).get(topics.camera) for k in ("first_ts_ns", "last_ts_ns"))
    if isinstance(first, int) and isinstance(last, int):
        figures["camera_span_ns"] = [first, last]
    return figures


def check_validated(job: dict, episode: "AlignedEpisode", path: Path) -> None:
    """Refuse an episode whose ``_vio.mcap`` is not the file pairing validated for its stem: its pose or gripper
    message count differs from :func:`validated_figures`, or a kept camera frame lies outside the camera span
    pairing measured. Catches what the manifest alone cannot (:func:`~dpflow_core.conversion.inputs.edited_entry`),
    e.g. another recording's file under this stem with its size and SHA-256 copied in.

    Raises:
        ConversionError: ``manifest_mismatch``, naming the stem, the file, the figure and both values.
    """
    want = job.get("validated") or {}
    streams = episode.report.get("streams", {})
    got = {f"{name}_count": streams[name]["count"] for name in ("pose", "gripper") if name in streams}
    for figure in ("pose_count", "gripper_count"):
        if figure in want and figure in got and want[figure] != got[figure]:
            _mismatch(job, path, f"its {figure.replace('_', ' ')} ({figure}) is {got[figure]}, pairing measured "
                                 f"{want[figure]}")
    if "camera_span_ns" in want and len(episode.camera_ts_ns):
        lo, hi = want["camera_span_ns"]
        first, last = int(episode.camera_ts_ns[0]), int(episode.camera_ts_ns[-1])
        if first < lo or last > hi:
            _mismatch(job, path, f"its camera frames run from capture time {first} to {last} ns, outside the camera "
                                 f"span pairing measured, {lo} to {hi} ns (camera_span_ns)")


def _mismatch(job: dict, path: Path, what: str) -> None:
    raise ConversionError(f"episode {job['stem']!r}: {path.name} is not the file pairing validated for this stem: "
                          f"{what}: {EDITED}", path, code="manifest_mismatch")


def settings_of_job(job: dict) -> ConversionSettings:
    """The alignment settings an :func:`alignment_job` carries (the rate settings, which alignment does not use,
    at their defaults); a key a job written by an older version lacks takes its old default.

    Raises:
        ConversionError: ``bad_option`` for an invalid value.
    """
    checks = job.get("content_checks") or {}
    return ConversionSettings(
        image_size=tuple(job["image_size"]) if job["image_size"] is not None else None,
        invalid_pose_policy=job["invalid_pose_policy"],
        min_overlap_fraction=job["min_overlap_fraction"],
        max_gap_s=job.get("max_gap_s", DEFAULT_MAX_GAP_S),
        gap_policy=job.get("gap_policy", "reject"),
        min_segment_frames=job.get("min_segment_frames", DEFAULT_MIN_SEGMENT_FRAMES),
        min_pose_score=job.get("min_pose_score", 0.0),
        short_episode_policy=checks.get("short_episode_policy", "reject"),
        plausibility=checks.get("plausibility"),
    )


def _short(n: int, seconds: float, minimum: int, what: str) -> str:
    return (f"{what} has {n} frames ({seconds:.2f} s), below the minimum episode length of {minimum} frames "
            "(min_segment_frames: the least that yields a training sample)")


def align_job_episode(job: dict, rgb_dir: str | Path | None) -> "AlignedEpisode":
    """:func:`align_episode` one manifest entry's ``_vio.mcap`` and check it against its recorded
    size and SHA-256 (the shared first step of the npz conversion and the LeRobot export). The
    hash is computed from the bytes the MCAP parser reads, so each input byte is read once.

    Args:
        job: an :func:`alignment_job`: ``stem``, ``vio_mcap`` (path), ``size_bytes`` and ``sha256`` from the
            manifest (either may be None), ``verify_sha256``, ``topics`` and the settings
            (:func:`settings_of_job`).
        rgb_dir: folder for the memory-mapped frames (None keeps them in RAM).

    Raises:
        ConversionError: ``missing_file``, or ``input_changed`` when size or SHA-256 differ
            from the manifest (the file changed since pairing, or the manifest was edited), ``manifest_mismatch``
            when the file is not the one pairing validated for the stem (:func:`check_validated`), ``too_short`` under
            ``short_episode_policy="reject"``, ``bad_option`` for a job with an invalid setting; and
            whatever :func:`align_episode` raises.
    """
    path = Path(job["vio_mcap"])
    if not path.exists():
        raise ConversionError("file not found", path, code="missing_file")
    if not path.is_file():
        raise ConversionError(f"{path.name} is {path_kind(path)}, not a file; a recording was expected there", path,
                              code="unreadable")
    if job["size_bytes"] is not None and path.stat().st_size != job["size_bytes"]:
        _changed(path, f"size is {path.stat().st_size} bytes but the manifest records {job['size_bytes']}")
    settings = settings_of_job(job)
    minimum = settings.min_segment_frames
    episode = align_episode(path, settings, topics=job["topics"], stem=job["stem"], rgb_dir=rgb_dir)
    # The SHA-256 comes from the bytes the parser read: the file is read once.
    if job["verify_sha256"] and job["sha256"] and episode.input_sha256 != job["sha256"]:
        _changed(path, f"SHA-256 is {episode.input_sha256} but the manifest records {job['sha256']}")
    check_validated(job, episode, path)
    # One minimum length for whole episodes and split pieces alike (align_episode drops the short pieces or,
    # under "warn", keeps them for the warnings here).
    if settings.short_episode_policy == "warn":
        pieces = [(0, len(episode))] if episode.segments is None else episode.segments
        warnings = [_short(b - a, float(episode.timestamps_s[b - 1] - episode.timestamps_s[a]), minimum,
                           "episode" if episode.segments is None else f"piece {k} (rows {a}-{b})")
                    for k, (a, b) in enumerate(pieces) if b - a < minimum]
        episode.report["short_episode"] = [{"code": "short_episode", "reason": w} for w in warnings]
    elif episode.segments is None and len(episode) < minimum:
        raise ConversionError(_short(len(episode), float(episode.timestamps_s[-1]), minimum, "episode")
                              + " and short_episode_policy is 'reject'", path, code="too_short")
    return episode


def _changed(path: Path, what: str) -> None:
    """``input_changed``: the episode's ``_vio.mcap`` (the one file conversion reads) is not what the manifest records."""
    raise ConversionError(f"{path} (the episode's vio_mcap): {what}: the file changed since pairing, or the manifest "
                          "was edited", path, code="input_changed")




def _episode_job(job: dict) -> dict:
    """Worker: align one episode and write its arrays as ``.npy`` files in ``job['dir']``.

    Returns a small summary: ``parts`` (one per episode kept, several when the episode
    was split at camera gaps: paths, lengths, report, value ranges), the whole
    episode's ``report``, ``seconds`` and ``peak_rss_mb``; a rejected episode returns
    ``{"ok": False, code, reason}`` (an OS error reading the input: code ``unreadable``
    with the error). Arrays never travel through the pipe.
    """
    started = time.perf_counter()
    stem, path, out_dir = job["stem"], Path(job["vio_mcap"]), Path(job["dir"])
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        whole = align_job_episode(job, out_dir)
        parts = []
        for k, ep in enumerate(split_segments(whole)):
            seg_dir = out_dir if whole.segments is None else out_dir / f"segment{k:03d}"
            seg_dir.mkdir(exist_ok=True)
            parts.append(_write_part(ep, seg_dir))
        return {
            "ok": True,
            "stem": stem,
            "parts": parts,
            "report": whole.report,
            "seconds": time.perf_counter() - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    except DpflowError as exc:
        return {"ok": False, "stem": stem, "path": exc.path or str(path), "code": exc.code, "reason": exc.reason}
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:  # the scratch folder's disk, not this episode, is at fault
            return {"ok": False, "stem": stem, "path": str(path), "code": "storage", "errno": exc.errno,
                    "reason": exc.strerror or str(exc)}
        return {"ok": False, "stem": stem, "path": exc.filename or str(path), "code": "unreadable",
                "reason": f"cannot read {Path(exc.filename or path).name}: {exc.strerror or exc} (errno {exc.errno})"}


def _write_part(ep, out_dir: Path) -> dict:
    """Write one episode (or segment) as ``.npy`` files; its summary for the parent."""
    n = len(ep)
    arrays = {
        "timestamp": ep.timestamps_s.astype(np.float64),
        "robot0_eef_pos": ep.eef_pos,
        "robot0_eef_rot_axis_angle": ep.eef_rot_axis_angle,
        "robot0_gripper_width": ep.gripper_width,
        "robot0_demo_start_pose": np.repeat(ep.start_pose[None], n, axis=0),
        "robot0_demo_end_pose": np.repeat(ep.end_pose[None], n, axis=0),
    }
    files = {}
    for key, arr in arrays.items():
        files[key] = str(out_dir / f"{key}.npy")
        np.save(files[key], np.ascontiguousarray(arr))
    ranges = {
        key: {"min": np.min(arr, axis=0).tolist(), "max": np.max(arr, axis=0).tolist()}
        for key, arr in arrays.items()
        if key != "timestamp"
    }
    # Measured while decoding: reading the frames back here would fault every page of them in.
    if ep.rgb_range is not None:
        ranges["camera0_rgb"] = {"min": int(ep.rgb_range[:, 0].min()), "max": int(ep.rgb_range[:, 1].max())}
    else:
        ranges["camera0_rgb"] = {"min": int(ep.rgb.min()), "max": int(ep.rgb.max())}
    return {
        "stem": ep.stem,
        "n": n,
        "start_ts_ns": int(ep.start_ts_ns),
        "rgb_path": str(ep.rgb_path),
        "rgb_rows": list(ep.rgb_rows),
        # The dataset writer joins these instead of reading the frames again for the zip's CRC.
        "rgb_crc32": ep.rgb_crc32(),
        "files": files,
        "report": ep.report,
        "ranges": ranges,
    }


#: ``prctl`` option: the signal sent to this process when its parent thread dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def die_with_parent(main_pid: int) -> None:
    """Worker initializer: never outlive the conversion that started this worker.

    Two guards, because a worker's parent is the forkserver, not the ``dpflow convert``
    process: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, through ctypes: the kernel kills
    the worker when its parent dies), and a daemon thread that exits the worker within
    0.2 s of ``main_pid`` (the converting process) being gone, e.g. after ``kill -9``.
    Source: prctl(2), PR_SET_PDEATHSIG.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while True:
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(0.2)

    if not pid_alive(main_pid):
        os._exit(1)
    threading.Thread(target=watch, name="dpflow-parent-watch", daemon=True).start()


def default_workers() -> int:
    """Worker processes for a conversion: the free cores, i.e. the cores this process may run on
    (``os.sched_getaffinity``) less the 1-minute load average (``os.getloadavg``: processes
    running or waiting to run), rounded, at least 1. On an idle 2-core machine 2; with other
    work occupying the cores 1, since a second worker would only compete with it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def _run_jobs(jobs: list[dict], workers: int, progress: Callable | None,
              on_done: Callable[[int, dict], dict] | None = None) -> list[dict]:
    """Run episode jobs (in worker processes when ``workers`` > 1, handed out largest input first);
    one summary per job, in job order. ``on_done(i, summary)`` is called in this thread as soon as
    job ``i`` ends (in the order they end), before the next result is waited for; what it returns
    replaces the summary.

    An exception inside a job (or a worker process that dies) becomes a rejection
    of that episode with the exception's type and message; none is lost. Workers
    exit when this process dies (:func:`die_with_parent`).
    """
    results: list[dict | None] = [None] * len(jobs)
    done = 0

    def finished(i: int, r: dict) -> None:
        nonlocal done
        results[i] = r
        if on_done is not None:
            results[i] = on_done(i, r)
        done += 1
        if progress:
            progress("episodes", done, len(jobs))

    def failed(job: dict, exc: BaseException) -> dict:
        return {"ok": False, "stem": job["stem"], "path": job["vio_mcap"], "code": "internal_error",
                "reason": f"{type(exc).__name__}: {exc}"}

    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            try:
                r = _episode_job(job)
            except Exception as exc:  # noqa: BLE001 - reported per episode
                r = failed(job, exc)
            finished(i, r)
        return results  # type: ignore[return-value]

    ctx = multiprocessing.get_context("forkserver")
    # What every worker imports (NumPy, PyAV, SciPy, mcap, protobuf): loaded once, in the forkserver,
    # and never in this process, which only writes the dataset.
    ctx.set_forkserver_preload(["dpflow_core.conversion.jobs", *ALIGN_IMPORTS])
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx,
                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        # Longest first (input size stands for length): the last episode to finish is then a short one,
        # so the workers run out of work together and the serial write phase starts sooner.
        order = sorted(range(len(jobs)), key=lambda i: -(jobs[i].get("size_bytes") or 0))
        futures = {pool.submit(_episode_job, jobs[i]): i for i in order}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            try:
                r = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported per episode
                r = failed(jobs[i], exc)
            finished(i, r)
    return results  # type: ignore[return-value]


def align_all(jobs: list[dict], episode_cache: EpisodeCache | None, workers: int,
               progress: Callable | None,
               on_result: Callable[[int, dict], None] | None = None) -> tuple[list[dict], int]:
    """Worker summaries of ``jobs`` in order, from the cache where it holds them, else aligned
    (:func:`_run_jobs`, ``workers`` processes, 0 = :func:`default_workers`) into new cache entries
    (or the jobs' scratch folders without a cache); and the number of worker processes used.

    ``on_result(i, summary)`` is called in this thread with each job's final summary (a cache
    entry's paths once stored) as soon as it is known: cache hits first, in job order, then the
    aligned episodes in the order they finish, so the caller can write them while others align.
    """
    results: list[dict | None] = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):
        hit = episode_cache.lookup(job) if episode_cache is not None else None
        if hit is not None:
            results[i] = {**hit, "in_cache": True}
            continue
        if episode_cache is not None and episode_key(job) is not None:
            job["dir"] = str(episode_cache.new_dir())
        todo.append(i)
    n_hits = len(jobs) - len(todo)
    if progress and n_hits:
        progress("episodes", n_hits, len(jobs))
    if on_result is not None:
        for i, r in enumerate(results):
            if r is not None:
                on_result(i, r)
    n_workers = workers if workers and workers > 0 else default_workers()
    n_workers = max(1, min(n_workers, len(todo)))
    counted = (lambda stage, done, total: progress(stage, n_hits + done, len(jobs))) if progress else None

    def done(k: int, r: dict) -> dict:
        i = todo[k]
        scratch = Path(jobs[i]["dir"])
        if episode_cache is not None and scratch.parent == episode_cache.root:
            if r["ok"]:
                r = {**episode_cache.store(jobs[i], r, scratch), "in_cache": True}
            else:
                shutil.rmtree(scratch, ignore_errors=True)
        results[i] = r
        if on_result is not None:
            on_result(i, r)
        return r

    try:
        _run_jobs([jobs[i] for i in todo], n_workers, counted, done)
    finally:
        if episode_cache is not None:
            for i in todo:
                scratch = Path(jobs[i]["dir"])
                if scratch.parent == episode_cache.root and scratch.name.startswith(".tmp-"):
                    shutil.rmtree(scratch, ignore_errors=True)
    return results, n_workers  # type: ignore[return-value]


class FrameStreamer:
    """Appends each episode's frames to ``writer`` in manifest order as soon as that episode and
    every one before it are aligned, on one helper thread (the kernel copies, copy_file_range(2),
    release the GIL), so the copying overlaps the alignment of later episodes: in worker processes
    with ``-j N``, in this process's main thread with ``-j 1``.

    :meth:`offer` takes the summaries in any order; the pieces are tagged (episode index, part
    index). A scratch frame file (not a cache entry's) is deleted once its last part is copied.
    """

    def __init__(self, writer: NpzStreamWriter):
        self.writer = writer
        self._pending: dict[int, dict] = {}
        self._next = 0
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="dpflow-npz-frames")
        self._copies: list[cf.Future] = []

    def offer(self, i: int, r: dict) -> None:
        """Episode ``i``'s summary (from :func:`align_all`); never raises (errors surface in :meth:`close`)."""
        self._pending[i] = r
        while self._next in self._pending:
            r = self._pending.pop(self._next)
            if r["ok"]:
                last = {part["rgb_path"]: k for k, part in enumerate(r["parts"])}
                for k, part in enumerate(r["parts"]):
                    drop = last[part["rgb_path"]] == k and not r.get("in_cache", False)
                    self._copies.append(self._pool.submit(self._append, (self._next, k), part, drop))
            self._next += 1

    def _append(self, tag: tuple[int, int], part: dict, drop: bool) -> None:
        a, b = part["rgb_rows"]
        row = self.writer.row_bytes
        self.writer.append(tag, part["rgb_path"], npy_data_offset(part["rgb_path"]) + a * row, (b - a) * row,
                           part.get("rgb_crc32"), drop=drop)

    def close(self) -> None:
        """Wait for the copies; the first error of any of them is raised here."""
        self._pool.shutdown(wait=True)
        for fut in self._copies:
            fut.result()

    def cancel(self) -> None:
        """Stop: copies not started are dropped, a running one is waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)
