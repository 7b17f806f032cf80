"""The checks one stem's files go through, and the checks across the accepted episodes.

:func:`check_candidate` runs the checks in this order; the first that fails is the stem's
reject (its ``code`` and a ``reason`` naming the file):

1. every file lies inside the task folder (``path_escapes_root``);
2. folder naming rules (not for an explicit manifest): a merged dual-arm stem
   (``unsupported_multi_arm``), a retry of a stem that is also there (``retry_duplicate``), a stem
   that is no safe file name (``invalid_stem``, :func:`~dpflow_core.names.validate_stem`), a
   lone ``<NAME>.mcap`` that is not a Matrix Studio recording (``missing_topics``) or one still
   waiting for VIO (``missing_partner``);
3. each file is a regular file (``unreadable``, ``missing_file``/``missing_partner``) and
   non-empty (``empty_file``);
4. the ``_vio.json`` parses (``unparseable_status``), names this task (``other_task``) and says
   success (``failed_status``, ``status_not_final``, ``unknown_status``), in agreement with
   ``vio_result.json`` (``status_conflict``);
5. both MCAP files pass :func:`~dpflow_core.recordings.inspect_recording` (its error codes,
   e.g. ``truncated_mcap``, or a second arm's ``/robotN/...`` topics: ``unsupported_multi_arm``);
6. the ``_vio.mcap`` holds the raw recording's camera (``raw_vio_mismatch``, :func:`raw_vio_mismatch`);
   a ``_vio.json`` whose ``frame_count`` or ``pose_count`` disagrees with it is accepted with the warning
   ``status_count_mismatch`` (:func:`~dpflow_core.recordings.stream_checks.status_count_problem`).

:func:`content_rejects` then compares the accepted episodes with each other: a later copy of an
episode (``duplicate_episode``) and a status file naming another stem (``status_stem_mismatch``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from mcap.exceptions import McapError
from mcap.reader import SeekingReader

from dpflow_core.errors import InvalidNameError, RecordingError
from dpflow_core.files import display_name, path_kind
from dpflow_core.names import validate_stem
from dpflow_core.pairing.manifest import ROLES, AcceptedEpisode, FileEntry, PairingReject
from dpflow_core.pairing.naming import SUFFIX, Candidate, inside, retry_base
from dpflow_core.pairing.status import TaskSummary, parse_vio_status, status_text, status_stems, status_value, unknown_status_reason
from dpflow_core.recordings import inspect_recording
from dpflow_core.recordings.stream_checks import status_count_problem
from dpflow_core.recordings.topics import TopicMap


def check_candidate(
    cand: Candidate,
    root: Path,
    task: str,
    summary: TaskSummary | None,
    all_stems: set[str],
    topics: TopicMap,
) -> AcceptedEpisode | PairingReject:
    """Run every pairing check on one stem (the order in the module docstring).

    Args:
        cand: the stem's files; root: the task folder (absolute); task: the task name.
        summary: the folder's ``vio_result.json``, or None.
        all_stems: every stem of the folder (a retry is a duplicate only when its base is there).
        topics: the topic map the MCAP files are validated with.

    Returns:
        The accepted episode (files sized, ``_vio.mcap`` and ``_vio.json`` hashed, validation
        figures) or the first failing check's reject.

    Raises:
        OSError: a file became unreadable between checks (the caller rejects the stem ``unreadable``).
    """
    reject = _path_reject(cand, root)
    if reject is None and not cand.explicit:
        reject = _naming_reject(cand, root, all_stems, topics)
    if reject is None:
        reject = _file_reject(cand)
    if reject is not None:
        return reject

    vio_json = cand.files["vio_json"]
    try:
        vio_json_bytes = vio_json.read_bytes()
        vio_status = json.loads(status_text(vio_json_bytes))  # UTF-8, or UTF-8/16/32 behind a byte-order mark
    except (OSError, ValueError) as exc:
        return PairingReject(cand.stem, str(vio_json), "unparseable_status", f"cannot parse {vio_json.name}: {exc}")

    reject = _status_reject(cand, vio_status, task, summary)
    if reject is not None:
        return reject

    try:
        vio_report = inspect_recording(cand.files["vio_mcap"], topics)
        raw_report = inspect_recording(cand.files["raw_mcap"], topics, required=(topics.camera, topics.gripper), probe_video=False)
    except RecordingError as exc:
        return PairingReject(cand.stem, exc.path or "", exc.code, exc.reason)
    for role, report in (("vio_mcap", vio_report), ("raw_mcap", raw_report)):
        if report.errors:
            first = report.errors[0]
            n_more = len(report.errors) - 1
            more = f" (and {n_more} more problem{'s' if n_more > 1 else ''})" if n_more else ""
            return PairingReject(cand.stem, str(cand.files[role]), first.code, first.reason + more)
    reject = raw_vio_mismatch(cand, vio_report, raw_report, vio_status, topics)
    if reject is not None:
        return reject

    validation = vio_report.to_dict()
    # An explicit manifest maps the files itself, so names inside its status files may differ.
    validation["status_stems"] = [] if cand.explicit else status_stems(vio_status)
    raw = raw_report.to_dict()
    validation["raw_mcap"] = {
        k: raw[k] for k in ("indexed", "message_counts", "summary_counts", "rates_hz", "log_time_inversions", "warnings")
    }
    validation["warnings"] = validation["warnings"] + raw["warnings"]
    counts = status_count_problem(vio_status, vio_json.name, cand.files["vio_mcap"].name,
                                  vio_report.message_counts.get(topics.pose, 0), vio_report.message_counts.get(topics.camera, 0))
    if counts is not None:
        validation["warnings"].append({"code": "status_count_mismatch", "reason": counts})
    # Each hash comes from the bytes already read for validation (each file is read once); the
    # raw .mcap is not hashed at all: conversion never reads it (it is validated, sized and listed).
    digests = {"vio_mcap": vio_report.sha256, "vio_json": hashlib.sha256(vio_json_bytes).hexdigest(), "raw_mcap": None}
    files = {}
    for role in ROLES:
        p = cand.files[role].resolve()
        files[role] = FileEntry(p, p.stat().st_size, digests[role])
    return AcceptedEpisode(cand.stem, files, vio_status, validation)


#: The VIO output's camera may start or end this much (s) beyond the raw recording's and still be its own.
RAW_VIO_TOLERANCE_S = 0.5


def raw_vio_mismatch(cand: Candidate, vio_report, raw_report, vio_status: Any, topics: TopicMap) -> PairingReject | None:
    """Step 6: the ``_vio.mcap`` holds the camera of its own raw recording (``raw_vio_mismatch``).

    VIO copies the raw recording's camera into its output (formats.md section 1), so both files carry
    it: equal camera payload hashes (:attr:`~dpflow_core.recordings.RecordingReport.camera_payload_sha256`)
    settle it. Otherwise (a VIO that re-encodes or trims) the output's camera must lie within the raw
    one's capture span (:data:`RAW_VIO_TOLERANCE_S` either side) and hold no more messages; two
    recordings' files swapped between stems fail that by their whole recording times. The reason names
    both files with their camera messages, first and last capture times, and the ``_vio.json``'s
    ``frame_count`` when it has one.
    """
    cam = topics.camera
    if vio_report.camera_payload_sha256 == raw_report.camera_payload_sha256:
        return None
    n_vio, n_raw = vio_report.message_counts.get(cam, 0), raw_report.message_counts.get(cam, 0)
    v0, v1 = vio_report.first_ts_ns.get(cam), vio_report.last_ts_ns.get(cam)
    r0, r1 = raw_report.first_ts_ns.get(cam), raw_report.last_ts_ns.get(cam)
    if None in (v0, v1, r0, r1):
        return None
    tol = RAW_VIO_TOLERANCE_S * 1e9
    if v0 >= r0 - tol and v1 <= r1 + tol and n_vio <= n_raw:
        return None
    counted = vio_status.get("frame_count") if isinstance(vio_status, dict) else None
    status_note = (f"; {cand.files['vio_json'].name} says frame_count {counted}"
                   if isinstance(counted, int) and not isinstance(counted, bool) else "")
    raw, vio = cand.files["raw_mcap"], cand.files["vio_mcap"]
    return PairingReject(cand.stem, str(vio), "raw_vio_mismatch", (
        f"{vio.name} does not hold the camera of {raw.name}: {raw.name} {n_raw} camera messages captured "
        f"{r0} to {r1} ns ({(r1 - r0) / 1e9:.3f} s), {vio.name} {n_vio} captured {v0} to {v1} ns, starting "
        f"{(v0 - r0) / 1e9:+.3f} s from the raw one{status_note}; camera payload SHA-256 "
        f"{(raw_report.camera_payload_sha256 or '')[:12]}... vs {(vio_report.camera_payload_sha256 or '')[:12]}...: "
        "the VIO output belongs to another recording (files swapped or renamed?): give each stem its own files"))


def _path_reject(cand: Candidate, root: Path) -> PairingReject | None:
    """Step 1: a file outside the task folder (``path_escapes_root``)."""
    stem, root_resolved = cand.stem, root.resolve()
    for role in ROLES:
        p = cand.files.get(role)
        if p is None:
            continue
        if not inside(p, root_resolved):
            target = os.path.realpath(p)
            how = f"is a link to {target}" if p.is_symlink() else f"resolves to {target}"
            return PairingReject(stem, str(p), "path_escapes_root", f"{p.name} {how}, outside the root {root}")
    return None


def _naming_reject(cand: Candidate, root: Path, all_stems: set[str], topics: TopicMap) -> PairingReject | None:
    """Step 2, the folder naming rules: merged, retry, not a Matrix Studio recording, missing partner."""
    stem = cand.stem
    any_file = next(iter(cand.files.values()))
    shown = display_name(stem)
    if shown != stem:
        return PairingReject(
            shown, display_name(any_file), "undecodable_name",
            f"{display_name(any_file.name)}: the file name is not valid UTF-8 (bytes shown as \\xNN); a stem must "
            "be a safe name to reach a dataset: rename the three files",
        )
    if ".merge" in stem:
        return PairingReject(
            stem, str(any_file), "unsupported_multi_arm",
            f"{any_file.name} is a Matrix Studio merged (multi-arm) recording; only single-arm recordings are "
            "converted and an arm is never dropped silently: use each arm's own recordings",
        )
    base = retry_base(stem)
    if base is not None and base in all_stems:
        return PairingReject(
            stem, str(any_file), "retry_duplicate",
            f"{any_file.name} is a retry duplicate of stem {base!r}: exact pairing uses {base}'s files "
            "(list this stem in an explicit manifest to use it instead)",
        )
    try:
        validate_stem(stem)
    except InvalidNameError as exc:
        return PairingReject(stem, str(any_file), "invalid_stem", f"{any_file.name}: {exc.reason}: rename the files")
    missing = [r for r in ROLES if r not in cand.files]
    if missing == ["vio_mcap", "vio_json"]:
        raw = cand.files["raw_mcap"]
        absent = _summary_missing_topics(raw, (topics.camera, topics.gripper))
        if absent:
            return PairingReject(
                stem, str(raw), "missing_topics",
                f"{raw.name}: not a Matrix Studio recording: missing topics {', '.join(absent)}",
            )
    if missing:
        names = [f"{stem}{SUFFIX[r]}" for r in missing]
        have = ", ".join(sorted(p.name for p in cand.files.values()))
        return PairingReject(
            stem, str(root / names[0]), "missing_partner",
            f"missing partner {' and '.join(names)} for {have}",
        )
    return None


def _file_reject(cand: Candidate) -> PairingReject | None:
    """Step 3: every file a regular file, and none empty."""
    stem = cand.stem
    for role in ROLES:
        p = cand.files[role]
        if p.exists() and not p.is_file():
            return PairingReject(
                stem, str(p), "unreadable",
                f"{p.name} is {path_kind(p)}, not a file; a {SUFFIX[role]} file was expected there: "
                "move it away and copy the recording's file in its place",
            )
        if not p.is_file():
            code = "missing_file" if cand.explicit else "missing_partner"
            what = "broken symbolic link" if p.is_symlink() else "file not found"
            return PairingReject(stem, str(p), code, f"{p.name}: {what}")
    for role in ROLES:
        p = cand.files[role]
        if p.stat().st_size == 0:
            return PairingReject(stem, str(p), "empty_file", f"{p.name} is empty (0 bytes)")
    return None


def _status_reject(cand: Candidate, vio_status: Any, task: str, summary: TaskSummary | None) -> PairingReject | None:
    """Step 4: the parsed ``_vio.json`` names this task and says success, as ``vio_result.json`` does."""
    stem, vio_json = cand.stem, cand.files["vio_json"]
    own_task = None
    if isinstance(vio_status, dict):
        own_task = next((vio_status[k] for k in ("task_name", "task") if isinstance(vio_status.get(k), str)), None)
    if own_task is not None and own_task != task:
        return PairingReject(stem, str(vio_json), "other_task", f"{vio_json.name} names task {own_task!r}, not {task!r}")
    if summary is not None and summary.task_name is not None and summary.task_name != task:
        return PairingReject(
            stem, str(summary.path), "other_task",
            f"vio_result.json names task {summary.task_name!r}, not {task!r}",
        )

    state = parse_vio_status(vio_status)
    if state == "failed":
        return PairingReject(stem, str(vio_json), "failed_status", f"{vio_json.name} says VIO failed ({status_value(vio_status)})")
    if state == "running":
        return PairingReject(
            stem, str(vio_json), "status_not_final", f"{vio_json.name} says VIO is not finished ({status_value(vio_status)})"
        )
    if state == "unknown":
        return PairingReject(stem, str(vio_json), "unknown_status", f"{vio_json.name}: {unknown_status_reason(vio_status)}")
    if summary is not None and not cand.explicit:
        if summary.failed is not None and stem in summary.failed:
            return PairingReject(
                stem, str(summary.path), "status_conflict",
                f"{vio_json.name} says success but vio_result.json lists {stem} in failed_mcap_files",
            )
        if summary.success is not None and stem not in summary.success:
            where = [f"under {found!r} (misspelt {key!r}?)" for found, (key, stems) in summary.misspelt.items()
                     if stem in stems]
            return PairingReject(
                stem, str(summary.path), "status_conflict",
                f"{vio_json.name} says success but vio_result.json does not list {stem} in success_mcap_files"
                + (f"; it lists it {', '.join(where)}" if where else ""),
            )
    return None


def content_rejects(accepted: list[AcceptedEpisode]) -> tuple[list[AcceptedEpisode], list[PairingReject]]:
    """Reject later copies of an earlier episode, and status files naming another stem.

    Episodes are taken in recording order (``_vio.mcap`` modification time, then stem):
    the first one with a given ``_vio.mcap`` SHA-256, or a given camera payload hash
    (``validation.camera_payload_sha256``: the same camera stream re-muxed), is kept;
    later ones are rejected ``duplicate_episode`` with a reason naming the episode they
    duplicate. A kept episode whose ``_vio.json`` names another stem is rejected
    ``status_stem_mismatch``: that status describes a different recording.
    """
    def order(a: AcceptedEpisode) -> tuple:
        try:
            return (a.vio_mcap.stat().st_mtime_ns, a.stem)
        except OSError:
            return (0, a.stem)

    by_file: dict[str, str] = {}
    by_camera: dict[str, str] = {}
    kept, rejects = [], []
    for a in sorted(accepted, key=order):
        named = [s for s in a.validation.get("status_stems", []) if s != a.stem]
        note = f"; its {a.vio_json.name} names stem {named[0]!r}" if named else ""
        sha = a.files["vio_mcap"].sha256
        cam = a.validation.get("camera_payload_sha256")
        if sha in by_file:
            rejects.append(PairingReject(
                a.stem, str(a.vio_mcap), "duplicate_episode",
                f"{a.vio_mcap.name} is a byte copy of episode {by_file[sha]!r} (SHA-256 {sha[:12]}...){note}; "
                "the same demonstration twice would weigh it double: delete the copy",
            ))
            continue
        if cam is not None and cam in by_camera:
            rejects.append(PairingReject(
                a.stem, str(a.vio_mcap), "duplicate_episode",
                f"{a.vio_mcap.name} holds the same camera stream as episode {by_camera[cam]!r} "
                f"(camera payload SHA-256 {cam[:12]}..., re-muxed copy){note}; delete the copy",
            ))
            continue
        by_file[sha] = a.stem
        if cam is not None:
            by_camera[cam] = a.stem
        if named:
            rejects.append(PairingReject(
                a.stem, str(a.vio_json), "status_stem_mismatch",
                f"{a.vio_json.name} names stem {named[0]!r}, not {a.stem!r}: the status file belongs to "
                "another recording (renamed or copied?); rename the files back or re-run VIO",
            ))
            continue
        kept.append(a)
    return sorted(kept, key=lambda a: a.stem), rejects


def _summary_missing_topics(path: Path, wanted: tuple[str, ...]) -> list[str] | None:
    """Topics of ``wanted`` absent from the channels listed in an MCAP file's summary section.

    Only the footer and summary are read (cheap even for a large file). Returns
    None when the file has no summary or it cannot be read; the full check is
    :func:`~dpflow_core.recordings.inspect_recording`'s.
    """
    try:
        with open(path, "rb") as f:
            summary = SeekingReader(f).get_summary()
    except (OSError, McapError, ValueError, struct.error):
        return None
    if summary is None:
        return None
    present = {channel.topic for channel in summary.channels.values()}
    return [t for t in wanted if t not in present]
