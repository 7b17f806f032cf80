"""Exact pairing of Matrix Studio outputs into a manifest of episodes.

A Matrix Studio task folder (formats.md section 1) holds, per recording, three
files with one exact stem::

    <STEM>.mcap  <STEM>_vio.mcap  <STEM>_vio.json

plus the task-level ``vio_result.json``. :func:`pair_recordings` accepts a stem
only when all three files are present inside the task folder, non-empty, the
status file says success (cross-checked with ``vio_result.json`` when present)
and both MCAP files pass :func:`dpflow_core.recordings.inspect_recording`.
Everything else is listed as rejected with a stable ``code`` and a ``reason``
naming the file; one bad episode never stops the others.

Naming rules (file names directly in the task folder; hidden files ignored):

- ``<STEM>_vio.mcap`` / ``<STEM>_vio.json`` belong to ``<STEM>``; any other
  ``<NAME>.mcap`` is the raw recording of stem ``<NAME>``.
- Dual-arm merged files (a stem containing ``.merge``, e.g. ``X.merge.mcap``)
  are rejected: ``unsupported_multi_arm`` (single-arm only), as is any file carrying
  ``/robotN/...`` topics of a second arm (found by inspection), so no arm is dropped silently.
- Retry duplicates: a stem ``<BASE>_retry<N>``, ``<BASE>-retry<N>`` or
  ``<BASE> (<N>)`` (a copy made by a file manager) whose ``<BASE>`` also has
  files in the folder is rejected: ``retry_duplicate``; exact pairing uses
  ``<BASE>``'s files. To use a retry instead, list it in an explicit manifest.
- ``.mcap`` files in subfolders of the task folder belong to another task or
  run: ``other_task``; so do stems whose ``_vio.json`` (keys ``task_name`` or
  ``task``) or ``vio_result.json`` (``task_name``) name a different task.
- A lone ``<NAME>.mcap`` (no ``_vio`` partners) whose summary section lacks
  the camera or gripper topic is another kind of MCAP (e.g. a ROS 2 bag):
  ``missing_topics``, "not a Matrix Studio recording: missing topics ...";
  otherwise it is a raw recording waiting for VIO: ``missing_partner``.
- A file that is a symbolic link resolving outside the task folder, or an
  explicit-manifest path with ``..`` leading outside it: ``path_escapes_root``.

The per-file status JSON has no published schema (formats.md), so it is read
defensively: a string under ``status``, ``state``, ``result`` or
``vio_status`` (also one level down under ``result``/``vio``/``status``), or a
boolean ``success``/``succeeded``/``ok``. Other layouts are ``unknown_status``.

Reject codes: ``path_escapes_root``, ``unsupported_multi_arm``, ``unreadable`` (an OS
error, or a directory/FIFO where a file was expected), ``invalid_stem``,
``retry_duplicate``, ``missing_partner``, ``missing_file``, ``empty_file``,
``unparseable_status``, ``other_task``, ``failed_status``,
``status_not_final``, ``unknown_status``, ``status_conflict``,
``duplicate_stem``, ``invalid_manifest_entry``, ``duplicate_episode`` (a later copy
of an accepted episode: same ``_vio.mcap`` SHA-256, or the same camera payload
re-muxed), ``status_stem_mismatch`` (the ``_vio.json`` names another stem), and the error codes of
:func:`~dpflow_core.recordings.inspect_recording` (``truncated_mcap``,
``missing_closing_magic``, ``corrupt_mcap``, ``unknown_encoding``, ...).

The result is a :class:`Manifest`, written as JSON by :func:`write_manifest`
and read back by :func:`load_manifest` (the conversion stage's input).

This module is over 500 lines because the manifest and the rules that fill it are one contract:
each reject code above is decided, serialised and read back (:func:`load_manifest`) here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from mcap.exceptions import McapError
from mcap.reader import SeekingReader

from dpflow_core.errors import InvalidNameError, PairingError, RecordingError
from dpflow_core.files import path_kind, write_text_atomic
from dpflow_core.names import validate_name
from dpflow_core.recordings import inspect_recording
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap
from dpflow_core.results import StageResult

MANIFEST_VERSION = 1
ROLES = ("raw_mcap", "vio_mcap", "vio_json")
_SUFFIX = {"raw_mcap": ".mcap", "vio_mcap": "_vio.mcap", "vio_json": "_vio.json"}
_HASH_BLOCK = 1 << 20

_SUCCESS = {"success", "succeeded", "successful", "ok", "done", "finished", "complete", "completed"}
_FAILED = {"failed", "failure", "fail", "error", "errored", "aborted", "cancelled", "canceled", "timeout"}
_RUNNING = {"running", "processing", "pending", "queued", "in_progress", "started", "waiting", "writing"}
_RETRY = re.compile(r"^(?P<base>.+?)(?:[_-]retry\d+| \(\d+\))$")


# ---------------------------------------------------------------------------
# Manifest data types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """One input file of an accepted episode.

    Attributes:
        path: absolute path; size_bytes: size in bytes; sha256: hex digest of its content
            (None for the raw ``.mcap``: conversion never reads it, so pairing does not hash it).
    """

    path: Path
    size_bytes: int
    sha256: str | None

    def to_dict(self) -> dict:
        return {"path": str(self.path), "size_bytes": self.size_bytes, "sha256": self.sha256}


@dataclass
class AcceptedEpisode:
    """An exact triple that passed pairing and validation.

    Attributes:
        stem: the file stem.
        files: ``raw_mcap``, ``vio_mcap`` and ``vio_json`` entries.
        vio_status: the raw parsed ``<STEM>_vio.json``.
        validation: figures of :class:`~dpflow_core.recordings.RecordingReport` of the
            ``_vio.mcap`` (``to_dict()``), plus ``raw_mcap`` (figures of the raw file)
            and ``warnings`` (faults tolerated, both files).
    """

    stem: str
    files: dict[str, FileEntry]
    vio_status: Any
    validation: dict

    @property
    def raw_mcap(self) -> Path:
        return self.files["raw_mcap"].path

    @property
    def vio_mcap(self) -> Path:
        return self.files["vio_mcap"].path

    @property
    def vio_json(self) -> Path:
        return self.files["vio_json"].path

    def to_dict(self) -> dict:
        return {
            "stem": self.stem,
            "files": {role: self.files[role].to_dict() for role in ROLES},
            "vio_status": self.vio_status,
            "validation": self.validation,
        }


@dataclass(frozen=True)
class PairingReject:
    """A stem or file left out of the manifest.

    Attributes:
        stem: the stem concerned ("" for task-level files such as ``vio_result.json``).
        path: the file at fault (for a missing partner: the path it should have).
        code: stable machine-readable code (see the module docstring).
        reason: human sentence naming the file.
    """

    stem: str
    path: str
    code: str
    reason: str

    def to_dict(self) -> dict:
        return {"stem": self.stem, "path": self.path, "code": self.code, "reason": self.reason}


@dataclass
class Manifest:
    """Result of pairing one task folder.

    Attributes:
        root: the task folder (absolute); task: the task name.
        created_at: ISO 8601 UTC time of pairing.
        topics: the :class:`TopicMap` used, as a dict.
        accepted: episodes in stem order; rejected: rejects in stem order.
        manifest_version: layout version (1).
    """

    root: Path
    task: str
    created_at: str
    topics: dict
    accepted: list[AcceptedEpisode] = field(default_factory=list)
    rejected: list[PairingReject] = field(default_factory=list)
    manifest_version: int = MANIFEST_VERSION

    def to_dict(self) -> dict:
        return {
            "manifest_version": self.manifest_version,
            "root": str(self.root),
            "task": self.task,
            "created_at": self.created_at,
            "topics": self.topics,
            "accepted": [a.to_dict() for a in self.accepted],
            "rejected": [r.to_dict() for r in self.rejected],
        }

    def topic_map(self) -> TopicMap:
        """The :class:`TopicMap` this manifest was paired with."""
        return topic_map_from_dict(self.topics)

    def content_hash(self) -> str:
        """SHA-256 (hex) of the manifest without ``created_at``: equal for equal input."""
        body = self.to_dict()
        body.pop("created_at")
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def topic_map_to_dict(topics: TopicMap) -> dict:
    """JSON-ready dict of a :class:`TopicMap` (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(topics).items()}


def topic_map_from_dict(data: dict) -> TopicMap:
    """Inverse of :func:`topic_map_to_dict`; unknown keys are ignored.

    Raises:
        PairingError: a value has the wrong type.
    """
    names = {f.name for f in dataclasses.fields(TopicMap)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            continue
        if isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return TopicMap(**kwargs)
    except TypeError as exc:
        raise PairingError(f"invalid topic map: {exc}") from exc


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def parse_vio_status(data: Any) -> str:
    """Classify a parsed ``_vio.json`` (or any status document).

    Returns:
        ``"success"``, ``"failed"``, ``"running"`` (not final yet) or ``"unknown"``
        (a layout or value this function does not know).
    """

    def find(obj: Any, depth: int) -> Any:
        if not isinstance(obj, dict):
            return None
        for key in ("status", "state", "result", "vio_status"):
            value = obj.get(key)
            if isinstance(value, (str, bool)):
                return value
        for key in ("success", "succeeded", "ok"):
            value = obj.get(key)
            if isinstance(value, bool):
                return value
        if depth == 0:
            for key in ("result", "vio", "status"):
                found = find(obj.get(key), 1)
                if found is not None:
                    return found
        return None

    value = find(data, 0)
    if isinstance(value, bool):
        return "success" if value else "failed"
    if isinstance(value, str):
        v = value.strip().lower().replace("-", "_").replace(" ", "_")
        if v in _SUCCESS:
            return "success"
        if v in _FAILED:
            return "failed"
        if v in _RUNNING:
            return "running"
    return "unknown"


def _status_value(data: Any) -> str:
    """The status string as written, for messages."""
    if isinstance(data, dict):
        for key in ("status", "state", "result", "vio_status", "success", "succeeded", "ok"):
            if key in data and not isinstance(data[key], dict):
                return f"{key} = {data[key]!r}"
    return "no status field"


_STATUS_KEYS = ("status", "state", "result", "vio_status", "success", "succeeded", "ok")


def _unknown_status_reason(data: Any) -> str:
    """Why :func:`parse_vio_status` found no status: the type or keys found, and what is expected."""
    expected = (f"expected a JSON object with one of the keys {', '.join(_STATUS_KEYS)} "
                "(a string such as \"success\", or a boolean)")
    if not isinstance(data, dict):
        return f"status unknown: the file holds a JSON {_json_type(data)}, not an object; {expected}"
    keys = ", ".join(sorted(map(str, data))) or "none"
    value = _status_value(data)
    if value != "no status field":
        return f"status unknown: {value} is not a recognised value (keys found: {keys}); {expected}"
    return f"status unknown: no recognised status key (keys found: {keys}); {expected}"


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(
        type(value), type(value).__name__)


def split_name(name: str) -> tuple[str, str] | None:
    """``(stem, role)`` of a Matrix Studio file name, or None for other files.

    ``role`` is ``raw_mcap``, ``vio_mcap`` or ``vio_json``; ``vio_result.json`` and
    hidden files (``.``-prefixed, e.g. temp files being written) give None.
    """
    if name.startswith(".") or name == "vio_result.json":
        return None
    for role in ("vio_mcap", "vio_json", "raw_mcap"):
        suffix = _SUFFIX[role]
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], role
    return None


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


def _inside(path: Path, root_resolved: Path) -> bool:
    try:
        path.resolve().relative_to(root_resolved)
        return True
    except ValueError:
        return False


def _stems_of_success_list(names: Any, root: Path | None = None,
                           bad: list[PairingReject] | None = None, key: str = "") -> set[str] | None:
    """Stems named by a ``vio_result.json`` file list. With ``root`` and ``bad``, an entry
    pointing into another folder (``other_task``) or whose stem is only dots
    (``invalid_stem``) is appended to ``bad`` and left out of the set."""
    if not isinstance(names, list):
        return None
    out = set()
    for name in names:
        if not isinstance(name, str):
            continue
        p = Path(name)
        split = split_name(p.name)
        stem = split[0] if split else (_dot_stem(p.name) or p.stem)
        if root is not None and bad is not None:
            where = p if p.is_absolute() else root / p
            if p.parent != Path(".") and not _inside(where, root.resolve()):
                bad.append(PairingReject(
                    stem, str(where), "other_task",
                    f"vio_result.json {key} lists {name!r}, which lies outside the task folder {root} "
                    "(another task's recording); it is not paired here",
                ))
                continue
            if stem and set(stem) == {"."}:
                bad.append(PairingReject(stem, str(where), "invalid_stem",
                                         f"vio_result.json {key} lists {name!r}: stem {stem!r} is only dots"))
                continue
        out.add(stem)
    return out


@dataclass
class _TaskSummary:
    """What ``vio_result.json`` says, when present and readable."""

    path: Path
    data: Any = None
    error: str | None = None
    success: set[str] | None = None
    failed: set[str] | None = None
    bad_entries: list[PairingReject] = field(default_factory=list)

    @property
    def task_name(self) -> str | None:
        value = self.data.get("task_name") if isinstance(self.data, dict) else None
        return value if isinstance(value, str) else None


def _read_task_summary(root: Path) -> _TaskSummary | None:
    path = root / "vio_result.json"
    if not path.is_file():
        return None
    summary = _TaskSummary(path)
    try:
        summary.data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        summary.error = f"{type(exc).__name__}: {exc}"
        return summary
    if isinstance(summary.data, dict):
        for key in ("success_mcap_files", "failed_mcap_files"):
            stems = _stems_of_success_list(summary.data.get(key), root, summary.bad_entries, key)
            if key == "success_mcap_files":
                summary.success = stems
            else:
                summary.failed = stems
    return summary


def _no_recordings(root: Path) -> PairingError:
    if not root.exists():
        return PairingError(f"no <STEM>.mcap files under {root}: no such folder", root, code="no_recordings")
    if not root.is_dir():
        return PairingError(f"no <STEM>.mcap files under {root}: not a folder", root, code="no_recordings")
    below = sorted({p.parent.relative_to(root).parts[0] for p in root.rglob("*.mcap")})
    hint = f" (task folders below it: {', '.join(below)}; pass one of them as the root)" if below else ""
    return PairingError(f"no <STEM>.mcap files under {root}{hint}", root, code="no_recordings")


# ---------------------------------------------------------------------------
# Pairing
# ---------------------------------------------------------------------------


@dataclass
class _Candidate:
    stem: str
    files: dict[str, Path]
    explicit: bool = False


def _scan_folder(root: Path) -> tuple[dict[str, _Candidate], list[PairingReject]]:
    """Group the files directly in ``root`` by stem; reject recordings in subfolders."""
    groups: dict[str, _Candidate] = {}
    rejects: list[PairingReject] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            split = _dot_stem(entry.name)
            if split is not None:
                rejects.append(PairingReject(
                    split, str(entry), "invalid_stem",
                    f"{entry.name}: stem {split!r} is only dots, not a recording name; rename the file",
                ))
            continue
        if entry.is_dir() and not entry.is_symlink() and split_name(entry.name) is None:
            nested: dict[tuple[Path, str], Path] = {}
            for p in sorted(entry.rglob("*.mcap")):
                if any(part.startswith(".") for part in p.relative_to(root).parts):
                    continue
                split = split_name(p.name)
                if split:
                    nested.setdefault((p.parent, split[0]), p)
            for (folder, stem), p in sorted(nested.items()):
                rel = folder.relative_to(root)
                rejects.append(PairingReject(
                    stem, str(p), "other_task",
                    f"{p.relative_to(root)} is in subfolder {rel}/, not in the task folder {root}: "
                    "another task or run",
                ))
            continue
        split = split_name(entry.name)
        if split is None:
            continue
        stem, role = split
        groups.setdefault(stem, _Candidate(stem, {})).files[role] = entry
    return groups, rejects


def _dot_stem(name: str) -> str | None:
    """The stem of a Matrix Studio file name whose stem is only dots (``..._vio.mcap``), else None.
    :func:`split_name` treats ``.``-prefixed names as hidden temp files; such a stem is neither."""
    for suffix in ("_vio.mcap", "_vio.json", ".mcap"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return stem if stem and set(stem) == {"."} else None
    return None




def _read_explicit(manifest_path: Path, root: Path) -> tuple[list[_Candidate], list[PairingReject]]:
    """Read an explicit pairing manifest: {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}]}.

    Paths are relative to ``root`` (absolute ones must lie inside it).
    """
    try:
        data = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PairingError("explicit manifest not found", manifest_path, code="missing_manifest") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PairingError(f"cannot parse explicit manifest: {exc}", manifest_path, code="bad_manifest") from exc
    entries = data.get("episodes") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise PairingError(
            'explicit manifest must be {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}, ...]}',
            manifest_path,
            code="bad_manifest",
        )
    candidates: list[_Candidate] = []
    rejects: list[PairingReject] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        stem = entry.get("stem") if isinstance(entry, dict) else None
        bad = [r for r in ROLES if not isinstance(entry, dict) or not isinstance(entry.get(r), str) or not entry.get(r)]
        if not isinstance(stem, str) or not stem or bad:
            what = "a stem" if not isinstance(stem, str) or not stem else ", ".join(bad)
            rejects.append(PairingReject(
                stem if isinstance(stem, str) else "", str(manifest_path), "invalid_manifest_entry",
                f"{Path(manifest_path).name}: entry {i} lacks {what}",
            ))
            continue
        try:
            validate_name(stem, "stem")
        except InvalidNameError as exc:
            rejects.append(PairingReject(
                stem, str(manifest_path), "invalid_stem", f"{Path(manifest_path).name}: entry {i}: {exc.reason}",
            ))
            continue
        if stem in seen:
            rejects.append(PairingReject(
                stem, str(manifest_path), "duplicate_stem",
                f"{Path(manifest_path).name}: entry {i} repeats stem {stem!r}; the first entry is used",
            ))
            continue
        seen.add(stem)
        candidates.append(_Candidate(stem, {r: root / entry[r] for r in ROLES}, explicit=True))
    return candidates, rejects


def _check_candidate(
    cand: _Candidate,
    root: Path,
    task: str,
    summary: _TaskSummary | None,
    all_stems: set[str],
    topics: TopicMap,
) -> AcceptedEpisode | PairingReject:
    """Run every pairing check on one stem; the first failing check is the reject."""
    stem = cand.stem
    root_resolved = root.resolve()

    for role in ROLES:
        p = cand.files.get(role)
        if p is None:
            continue
        if not _inside(p, root_resolved):
            target = os.path.realpath(p)
            how = f"is a link to {target}" if p.is_symlink() else f"resolves to {target}"
            return PairingReject(stem, str(p), "path_escapes_root", f"{p.name} {how}, outside the root {root}")

    if not cand.explicit:
        any_file = next(iter(cand.files.values()))
        if ".merge" in stem:
            return PairingReject(
                stem, str(any_file), "unsupported_multi_arm",
                f"{any_file.name} is a Matrix Studio merged (multi-arm) recording; only single-arm recordings are "
                "converted and an arm is never dropped silently: use each arm's own recordings",
            )
        retry = _RETRY.match(stem)
        if retry and retry.group("base") in all_stems:
            base = retry.group("base")
            return PairingReject(
                stem, str(any_file), "retry_duplicate",
                f"{any_file.name} is a retry duplicate of stem {base!r}: exact pairing uses {base}'s files "
                "(list this stem in an explicit manifest to use it instead)",
            )
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
            names = [f"{stem}{_SUFFIX[r]}" for r in missing]
            have = ", ".join(sorted(p.name for p in cand.files.values()))
            return PairingReject(
                stem, str(root / names[0]), "missing_partner",
                f"missing partner {' and '.join(names)} for {have}",
            )

    for role in ROLES:
        p = cand.files[role]
        if p.exists() and not p.is_file():
            return PairingReject(
                stem, str(p), "unreadable",
                f"{p.name} is {path_kind(p)}, not a file; a {_SUFFIX[role]} file was expected there: "
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

    vio_json = cand.files["vio_json"]
    try:
        vio_json_bytes = vio_json.read_bytes()
        vio_status = json.loads(vio_json_bytes.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return PairingReject(stem, str(vio_json), "unparseable_status", f"cannot parse {vio_json.name}: {exc}")

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
        return PairingReject(stem, str(vio_json), "failed_status", f"{vio_json.name} says VIO failed ({_status_value(vio_status)})")
    if state == "running":
        return PairingReject(
            stem, str(vio_json), "status_not_final", f"{vio_json.name} says VIO is not finished ({_status_value(vio_status)})"
        )
    if state == "unknown":
        return PairingReject(stem, str(vio_json), "unknown_status", f"{vio_json.name}: {_unknown_status_reason(vio_status)}")
    if summary is not None and not cand.explicit:
        if summary.failed is not None and stem in summary.failed:
            return PairingReject(
                stem, str(summary.path), "status_conflict",
                f"{vio_json.name} says success but vio_result.json lists {stem} in failed_mcap_files",
            )
        if summary.success is not None and stem not in summary.success:
            return PairingReject(
                stem, str(summary.path), "status_conflict",
                f"{vio_json.name} says success but vio_result.json does not list {stem} in success_mcap_files",
            )

    try:
        vio_report = inspect_recording(cand.files["vio_mcap"], topics)
        raw_report = inspect_recording(cand.files["raw_mcap"], topics, required=(topics.camera, topics.gripper), probe_video=False)
    except RecordingError as exc:
        return PairingReject(stem, exc.path or "", exc.code, exc.reason)
    for role, report in (("vio_mcap", vio_report), ("raw_mcap", raw_report)):
        if report.errors:
            first = report.errors[0]
            n_more = len(report.errors) - 1
            more = f" (and {n_more} more problem{'s' if n_more > 1 else ''})" if n_more else ""
            return PairingReject(stem, str(cand.files[role]), first.code, first.reason + more)

    validation = vio_report.to_dict()
    # An explicit manifest maps the files itself, so names inside its status files may differ.
    validation["status_stems"] = [] if cand.explicit else _status_stems(vio_status)
    raw = raw_report.to_dict()
    validation["raw_mcap"] = {
        k: raw[k] for k in ("indexed", "message_counts", "summary_counts", "rates_hz", "log_time_inversions", "warnings")
    }
    validation["warnings"] = validation["warnings"] + raw["warnings"]
    # Each hash comes from the bytes already read for validation (each file is read once); the
    # raw .mcap is not hashed at all: conversion never reads it (it is validated, sized and listed).
    digests = {"vio_mcap": vio_report.sha256, "vio_json": hashlib.sha256(vio_json_bytes).hexdigest(), "raw_mcap": None}
    files = {}
    for role in ROLES:
        p = cand.files[role].resolve()
        files[role] = FileEntry(p, p.stat().st_size, digests[role])
    return AcceptedEpisode(stem, files, vio_status, validation)


def _status_stems(vio_status: Any) -> list[str]:
    """Stems the ``_vio.json`` itself names (keys ``stem``, ``input_file``, ``output_file``,
    ``input``, ``output``; file names reduced to their stem), sorted and unique."""
    if not isinstance(vio_status, dict):
        return []
    out = set()
    for key in ("stem", "input_file", "output_file", "input", "output"):
        value = vio_status.get(key)
        if not isinstance(value, str) or not value:
            continue
        name = Path(value).name
        split = split_name(name)
        out.add(split[0] if split else (value if key == "stem" else Path(name).stem))
    return sorted(out)


def _content_rejects(accepted: list[AcceptedEpisode]) -> tuple[list[AcceptedEpisode], list[PairingReject]]:
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


def pair_recordings(
    root: str | Path,
    topics: TopicMap = DAS_DEFAULT,
    explicit_manifest: str | Path | None = None,
    task: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Manifest:
    """Pair the recordings of one Matrix Studio task folder by exact stem.

    Args:
        root: the task folder (``output/<task_name>/``).
        topics: topic map used to validate the MCAP files.
        explicit_manifest: optional JSON file ``{"episodes": [{"stem": ..., "raw_mcap": ...,
            "vio_mcap": ..., "vio_json": ...}]}`` with paths relative to ``root``, for
            naming schemes that differ; then only its entries are considered, each checked
            (inside the root, present, non-empty, status success, valid MCAP); the folder
            naming rules and the ``vio_result.json`` file lists are not applied.
        task: the task name; default ``task_name`` of ``vio_result.json``, else the
            folder name. Stems naming another task are rejected (``other_task``).
        progress: called as ``progress(stem, done, total)`` after each stem.

    Returns:
        The manifest: accepted episodes (files with sizes and SHA-256, validation
        figures) and rejects (stem, path, code, reason), both sorted by stem.

    Raises:
        PairingError: ``root`` holds no ``<STEM>.mcap`` file (code ``no_recordings``,
            reason "no <STEM>.mcap files under <root>"; with an explicit manifest: ``root``
            is not a folder), or the explicit manifest is missing or malformed.
        InvalidNameError: the task name is not a safe name.
    """
    root = Path(root).absolute()
    if explicit_manifest is None and (not root.is_dir() or not any(
        p.is_file() and split_name(p.name) and p.name.endswith(".mcap") for p in root.iterdir()
    )):
        raise _no_recordings(root)
    if not root.is_dir():
        raise PairingError(f"{root} is not a folder", root, code="no_recordings")
    summary = _read_task_summary(root)
    if task is None:
        task = (summary.task_name if summary is not None else None) or root.name
    validate_name(task, "task")

    if explicit_manifest is not None:
        candidates, rejects = _read_explicit(Path(explicit_manifest), root)
    else:
        groups, rejects = _scan_folder(root)
        candidates = [groups[s] for s in sorted(groups)]
    if summary is not None:
        rejects.extend(summary.bad_entries)
    if summary is not None and summary.error is not None:
        rejects.append(PairingReject(
            "", str(summary.path), "unparseable_status",
            f"cannot parse vio_result.json: {summary.error}; the task-level cross-check was skipped",
        ))

    all_stems = {c.stem for c in candidates}
    accepted: list[AcceptedEpisode] = []
    for i, cand in enumerate(candidates):
        try:
            result = _check_candidate(cand, root, task, summary, all_stems, topics)
        except OSError as exc:
            name = Path(exc.filename).name if exc.filename else cand.stem
            result = PairingReject(cand.stem, str(exc.filename or root), "unreadable",
                                   f"cannot read {name}: {exc.strerror or exc} (errno {exc.errno})")
        (accepted if isinstance(result, AcceptedEpisode) else rejects).append(result)
        if progress is not None:
            progress(cand.stem, i + 1, len(candidates))
    accepted, content = _content_rejects(accepted)
    rejects.extend(content)
    rejects.sort(key=lambda r: (r.stem, r.path))
    return Manifest(
        root=root,
        task=task,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topics=topic_map_to_dict(topics),
        accepted=sorted(accepted, key=lambda a: a.stem),
        rejected=rejects,
    )


def reject_summary(rejected: list, limit: int = 6) -> str:
    """One line per reject code, most frequent first: ``code xN (stem: reason)`` with the
    first example's reason. Accepts :class:`PairingReject` objects or their dicts."""
    by_code: dict[str, list] = {}
    for r in rejected:
        d = r.to_dict() if isinstance(r, PairingReject) else dict(r)
        by_code.setdefault(str(d.get("code")), []).append(d)
    lines = []
    for code, items in sorted(by_code.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:limit]:
        first = items[0]
        lines.append(f"{code} x{len(items)} (e.g. {first.get('stem') or first.get('path')}: {first.get('reason')})")
    if len(by_code) > limit:
        lines.append(f"... and {len(by_code) - limit} more codes")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Reading and writing manifests
# ---------------------------------------------------------------------------


def write_manifest(manifest: Manifest, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``manifest`` as JSON: to a temp name in the same folder, then renamed.

    Raises:
        PairingError: ``path`` exists and ``overwrite`` is false (code ``output_exists``).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise PairingError("manifest already exists (pass --overwrite (overwrite=True from Python) to replace it)", path, code="output_exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(manifest.to_dict(), indent=2) + "\n")


def _need(obj: Any, key: str, kind: type | tuple, where: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise PairingError(f"malformed manifest: {where} has no {key!r}", path, code="bad_manifest")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PairingError(f"malformed manifest: {where}.{key} has type {type(value).__name__}", path, code="bad_manifest")
    return value


def manifest_from_dict(data: Any, path: str | Path = "<manifest>") -> Manifest:
    """Build a :class:`Manifest` from its JSON dict, checking every field.

    Raises:
        PairingError: a key is missing or has the wrong type, or the version is not 1.
    """
    path = Path(path)
    version = _need(data, "manifest_version", int, "manifest", path)
    if version != MANIFEST_VERSION:
        raise PairingError(f"unsupported manifest_version {version} (expected {MANIFEST_VERSION})", path, code="bad_manifest")
    accepted = []
    for i, item in enumerate(_need(data, "accepted", list, "manifest", path)):
        where = f"accepted[{i}]"
        stem = _need(item, "stem", str, where, path)
        files_in = _need(item, "files", dict, where, path)
        files = {}
        for role in ROLES:
            entry = _need(files_in, role, dict, f"{where}.files", path)
            files[role] = FileEntry(
                Path(_need(entry, "path", str, f"{where}.files.{role}", path)),
                _need(entry, "size_bytes", int, f"{where}.files.{role}", path),
                _need(entry, "sha256", (str, type(None)) if role == "raw_mcap" else str, f"{where}.files.{role}", path),
            )
        if "vio_status" not in item:
            raise PairingError(f"malformed manifest: {where} has no 'vio_status'", path, code="bad_manifest")
        accepted.append(AcceptedEpisode(stem, files, item["vio_status"], _need(item, "validation", dict, where, path)))
    rejected = []
    for i, item in enumerate(_need(data, "rejected", list, "manifest", path)):
        where = f"rejected[{i}]"
        rejected.append(PairingReject(*(_need(item, k, str, where, path) for k in ("stem", "path", "code", "reason"))))
    return Manifest(
        root=Path(_need(data, "root", str, "manifest", path)),
        task=_need(data, "task", str, "manifest", path),
        created_at=_need(data, "created_at", str, "manifest", path),
        topics=_need(data, "topics", dict, "manifest", path),
        accepted=accepted,
        rejected=rejected,
        manifest_version=version,
    )


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest written by :func:`write_manifest`.

    Raises:
        PairingError: the file is missing, not JSON, or malformed (names the file and field).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PairingError("manifest not found", path, code="missing_manifest") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PairingError(f"cannot parse manifest: {exc}", path, code="bad_manifest") from exc
    return manifest_from_dict(data, path)


# ---------------------------------------------------------------------------
# Watching a task folder (used by the recordings sensor)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StemSnapshot:
    """Sizes and modification times of one stem's files, as seen now.

    Attributes:
        stem: the stem.
        files: per role present, ``(size_bytes, mtime_s)``.
        status: ``parse_vio_status`` of the ``_vio.json`` (``"success"``, ``"failed"``,
            ``"running"``, ``"unknown"``), ``"unparseable"`` (possibly still being
            written) or None when there is no ``_vio.json``.
    """

    stem: str
    files: dict[str, tuple[int, float]]
    status: str | None

    @property
    def complete(self) -> bool:
        return all(r in self.files for r in ROLES)

    @property
    def final(self) -> bool:
        """All three files present and a status that will not change by itself."""
        return self.complete and self.status in ("success", "failed", "unknown")

    @property
    def size_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    @property
    def mtime(self) -> float:
        return max((m for _, m in self.files.values()), default=0.0)


def snapshot_stems(root: str | Path) -> dict[str, StemSnapshot]:
    """Stat every ``<STEM>`` file directly in a task folder (no hashing, no MCAP reading).

    Returns:
        Per stem, its :class:`StemSnapshot`; empty when ``root`` is not a folder.
    """
    root = Path(root)
    if not root.is_dir():
        return {}
    found: dict[str, dict[str, Path]] = {}
    for entry in root.iterdir():
        split = split_name(entry.name)
        if split is None or not entry.is_file():
            continue
        found.setdefault(split[0], {})[split[1]] = entry
    out = {}
    for stem, files in sorted(found.items()):
        stats = {}
        for role, p in files.items():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            stats[role] = (st.st_size, st.st_mtime)
        status = None
        if "vio_json" in files:
            try:
                status = parse_vio_status(json.loads(files["vio_json"].read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                status = "unparseable"
        out[stem] = StemSnapshot(stem, stats, status)
    return out


def manifest_path_for(output_dir: str | Path, manifest: Manifest) -> Path:
    """Content-addressed manifest location: ``<output_dir>/manifests/<task>-<12 hex>.json``.

    The hex digits are the start of :meth:`Manifest.content_hash`, so pairing unchanged
    input again names the same file and never overwrites a different one.
    """
    return Path(output_dir) / "manifests" / f"{manifest.task}-{manifest.content_hash()[:12]}.json"


def save_manifest(manifest: Manifest, output_dir: str | Path) -> tuple[Path, bool]:
    """Write ``manifest`` to :func:`manifest_path_for` unless an equal one is there.

    Returns:
        (path, written): ``written`` is false when an equal manifest already existed.

    Raises:
        PairingError: a file with that name exists but holds a different manifest.
    """
    path = manifest_path_for(output_dir, manifest)
    if path.exists():
        if load_manifest(path).content_hash() != manifest.content_hash():
            raise PairingError("a different manifest already has this name", path, code="output_exists")
        return path, False
    return write_manifest(manifest, path), True


@dataclass(frozen=True)
class PairedEpisodes(StageResult):
    """A saved pairing manifest: what the ``paired_episodes`` asset passes on (``to_dict``/``from_dict``).

    Attributes:
        manifest_path: the manifest JSON (content-addressed when made by :func:`save_manifest`).
        root: the task folder that was paired.
        task: the task name.
        accepted: episodes accepted (count); rejected: files or stems rejected (count).
    """

    manifest_path: str
    root: str
    task: str
    accepted: int
    rejected: int

    @classmethod
    def of(cls, manifest: Manifest, path: str | Path) -> "PairedEpisodes":
        """The summary of ``manifest`` saved at ``path``."""
        return cls(str(path), str(manifest.root), manifest.task, len(manifest.accepted), len(manifest.rejected))
