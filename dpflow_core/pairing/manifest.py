"""The pairing manifest: its types, and how it is written, named and read back.

A :class:`Manifest` is what :func:`dpflow_core.pairing.pair_recordings` returns for one task
folder: the accepted episodes (their files with sizes and SHA-256, and the validation figures)
and the rejects (stem, path, code, reason). :func:`write_manifest` writes it as JSON (temp name,
then rename), :func:`save_manifest` under a content-addressed name (:func:`manifest_path_for`),
and :func:`load_manifest` reads it back, checking every field (:func:`manifest_from_dict`).
:func:`read_manifest_json` is the one reader of a manifest file: it parses the JSON and names
the file in every error; :func:`load_manifest` and the quality report (:mod:`dpflow_core.report`)
both read through it. :class:`PairedEpisodes` is the summary the ``paired_episodes`` asset passes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpflow_core.errors import InvalidNameError, PairingError
from dpflow_core.files import display_name, os_errors_named, remove_stale_temporaries, write_text_atomic
from dpflow_core.names import validate_name
from dpflow_core.recordings.topics import TopicMap
from dpflow_core.results import StageResult

MANIFEST_VERSION = 1
#: The files of an episode, by role: ``<STEM>.mcap``, ``<STEM>_vio.mcap``, ``<STEM>_vio.json``.
ROLES = ("raw_mcap", "vio_mcap", "vio_json")


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


def pairing_warnings(entry: Any) -> list[dict]:
    """The faults pairing tolerated in one accepted manifest entry (``validation.warnings`` of both files,
    e.g. ``duplicate_timestamps``, ``late_start``, ``timestamp_units`` of an optional stream), each
    ``{"code", "reason", "stage": "pairing"}``, for a dataset's ``warnings``; [] for an entry without them.
    ``entry``: an :class:`AcceptedEpisode` or its dict."""
    validation = entry.validation if isinstance(entry, AcceptedEpisode) else (
        entry.get("validation") if isinstance(entry, dict) else None)
    found = validation.get("warnings") if isinstance(validation, dict) else None
    return [{"code": str(w.get("code")), "reason": str(w.get("reason")), "stage": "pairing"}
            for w in (found if isinstance(found, list) else []) if isinstance(w, dict) and w.get("code")]


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


def write_manifest(manifest: Manifest, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``manifest`` as JSON: to a temp name in the same folder, then renamed.

    Raises:
        PairingError: ``path`` exists and ``overwrite`` is false (code ``output_exists``).
        StorageError: the folder cannot be written (disk full, permission denied, read-only), naming ``path``;
            no temporary is left.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise PairingError("manifest already exists (pass --overwrite (overwrite=True from Python) to replace it)", path, code="output_exists")
    with os_errors_named(path, "writing the manifest"):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
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
        try:
            # The one place every reader of a manifest (convert, cache, report, export) gets its
            # stems from: a hand-edited '../../x' never reaches a file path.
            validate_name(stem, "stem")
        except InvalidNameError as exc:
            raise PairingError(f"malformed manifest: {where} '{display_name(stem)}': {exc.reason}", path,
                               code="bad_manifest") from exc
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
    return manifest_from_dict(read_manifest_json(path), path)


def read_manifest_json(path: str | Path) -> dict:
    """The parsed JSON object of a manifest file, its fields not checked (:func:`load_manifest` checks them).

    Raises:
        PairingError: the file is missing (code ``missing_manifest``), cannot be read, is not
            UTF-8 JSON, or holds no JSON object (code ``bad_manifest``); the error names the file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PairingError("manifest not found", path, code="missing_manifest") from exc
    except OSError as exc:
        raise PairingError(f"cannot parse manifest: {exc}", path, code="bad_manifest") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PairingError(f"cannot parse manifest: not valid JSON: {exc}", path, code="bad_manifest") from exc
    if not isinstance(data, dict):
        raise PairingError("malformed manifest: not a JSON object", path, code="bad_manifest")
    return data


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
