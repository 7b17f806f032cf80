"""Reading Matrix Studio's status files: each recording's ``<STEM>_vio.json`` and the task's ``vio_result.json``.

The per-file status JSON has no published schema (formats.md), so it is read
defensively (:func:`parse_vio_status`): a string under ``status``, ``state``, ``result`` or
``vio_status`` (also one level down under ``result``/``vio``/``status``), or a
boolean ``success``/``succeeded``/``ok``. Other layouts are ``unknown``, and the reject's
reason says what was found and what is expected (:func:`unknown_status_reason`).

Both are read as UTF-8, or UTF-8/16/32 behind a byte-order mark (:func:`status_text`).

The task-level ``vio_result.json`` (:func:`read_task_summary`) may name the task
(``task_name``) and list the files VIO finished (``success_mcap_files``) or failed
(``failed_mcap_files``); pairing cross-checks each stem's own status against those lists.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpflow_core.pairing.manifest import PairingReject
from dpflow_core.pairing.naming import dot_stem, inside, split_name

_SUCCESS = {"success", "succeeded", "successful", "ok", "done", "finished", "complete", "completed"}
_FAILED = {"failed", "failure", "fail", "error", "errored", "aborted", "cancelled", "canceled", "timeout"}
_RUNNING = {"running", "processing", "pending", "queued", "in_progress", "started", "waiting", "writing"}
_STATUS_KEYS = ("status", "state", "result", "vio_status", "success", "succeeded", "ok")


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


#: Byte-order marks a Windows editor writes, longest first (UTF-32 LE begins with UTF-16 LE's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32-be", "UTF-32"),
         (codecs.BOM_UTF8, "utf-8", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16-le", "UTF-16"),
         (codecs.BOM_UTF16_BE, "utf-16-be", "UTF-16"))


def status_text(raw: bytes) -> str:
    """The text of a status JSON file (``_vio.json``, ``vio_result.json``): UTF-8, or UTF-8, UTF-16 or
    UTF-32 behind a byte-order mark (what Windows editors write: Notepad's "Unicode" is UTF-16 LE with a
    BOM); the mark is not part of the text.

    Raises:
        ValueError: the bytes are none of these; the message names what they look like (UTF-16 or UTF-32
            without a mark: NUL bytes between ASCII ones) and says to save the file as UTF-8.
    """
    for bom, codec, name in _BOMS:
        if raw.startswith(bom):
            try:
                return raw[len(bom):].decode(codec)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{name} text (byte-order mark) that does not decode: {exc.reason} at byte "
                                 f"{exc.start + len(bom)}; save it as UTF-8") from None
    if b"\x00" in raw[:4]:
        width = "UTF-32" if raw[:4].count(0) >= 3 else "UTF-16"
        raise ValueError(f"{width} text without a byte-order mark (NUL bytes between the characters); "
                         "save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at {exc.start} ({exc.reason}); "
                         "save it as UTF-8") from None


def read_vio_status(path: Path) -> str:
    """:func:`parse_vio_status` of a ``_vio.json`` file, or ``"unparseable"`` when it cannot be
    read or parsed (it may still be being written)."""
    try:
        return parse_vio_status(json.loads(status_text(path.read_bytes())))
    except (OSError, ValueError):
        return "unparseable"


def status_value(data: Any) -> str:
    """The status string as written, for messages."""
    if isinstance(data, dict):
        for key in _STATUS_KEYS:
            if key in data and not isinstance(data[key], dict):
                return f"{key} = {data[key]!r}"
    return "no status field"


def unknown_status_reason(data: Any) -> str:
    """Why :func:`parse_vio_status` found no status: the type or keys found, and what is expected."""
    expected = (f"expected a JSON object with one of the keys {', '.join(_STATUS_KEYS)} "
                "(a string such as \"success\", or a boolean)")
    if not isinstance(data, dict):
        return f"status unknown: the file holds a JSON {_json_type(data)}, not an object; {expected}"
    keys = ", ".join(sorted(map(str, data))) or "none"
    value = status_value(data)
    if value != "no status field":
        return f"status unknown: {value} is not a recognised value (keys found: {keys}); {expected}"
    return f"status unknown: no recognised status key (keys found: {keys}); {expected}"


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(
        type(value), type(value).__name__)


def status_stems(vio_status: Any) -> list[str]:
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
        stem = split[0] if split else (dot_stem(p.name) or p.stem)
        if root is not None and bad is not None:
            where = p if p.is_absolute() else root / p
            if p.parent != Path(".") and not inside(where, root.resolve()):
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
class TaskSummary:
    """What ``vio_result.json`` says.

    Attributes:
        path: the file; data: its parsed JSON (None when unparseable); error: why it could not
            be parsed, else None.
        success, failed: stems of ``success_mcap_files`` / ``failed_mcap_files`` (None when
            the list is absent).
        bad_entries: list entries rejected (``other_task``, ``invalid_stem``), and misspelt list keys beside a
            correct one (``bad_task_summary``).
        error_code: the code of ``error``.
        misspelt: a misspelt list key -> (the key it misspells, the stems it lists), not read.
    """

    path: Path
    data: Any = None
    error: str | None = None
    success: set[str] | None = None
    failed: set[str] | None = None
    bad_entries: list[PairingReject] = field(default_factory=list)
    error_code: str = "unparseable_status"
    misspelt: dict[str, tuple[str, set[str]]] = field(default_factory=dict)

    @property
    def task_name(self) -> str | None:
        value = self.data.get("task_name") if isinstance(self.data, dict) else None
        return value if isinstance(value, str) else None


_SUMMARY_KEYS = ("success_mcap_files", "failed_mcap_files")


def near_miss_keys(data: dict) -> list[tuple[str, str]]:
    """``(found, meant)`` for each key of a ``vio_result.json`` object that is not one of
    ``success_mcap_files`` / ``failed_mcap_files`` but close to one (``difflib`` ratio 0.75 or more) and
    holds a list, as the misspelt list would: ``('sucess_mcap_files', 'success_mcap_files')``."""
    import difflib

    others = [str(k) for k in data if k not in _SUMMARY_KEYS and isinstance(data[k], list)]
    return [(found, key) for key in _SUMMARY_KEYS
            for found in difflib.get_close_matches(key, others, n=1, cutoff=0.75)]


def _layout_error(data: Any) -> str | None:
    """Why a parsed ``vio_result.json`` cannot be cross-checked (not an object, or neither list key,
    naming a key that looks like a misspelling of one), or None."""
    if not isinstance(data, dict):
        what = "an empty list" if data == [] else f"a JSON {type(data).__name__}"
        return f"vio_result.json holds {what}, not an object with {' or '.join(_SUMMARY_KEYS)}"
    if any(k in data for k in _SUMMARY_KEYS):
        return None
    hints = [f"{found!r} for {key!r}" for found, key in near_miss_keys(data)]
    keys = ", ".join(repr(k) for k in list(data)[:8]) or "none"
    return (f"vio_result.json has no {' or '.join(_SUMMARY_KEYS)} key (keys: {keys})"
            + (f"; misspelt? {', '.join(hints)}" if hints else ""))


def _near_miss_rejects(summary: "TaskSummary", root: Path) -> None:
    """Beside a correctly spelt list key, a near miss of the other (or of itself) is no list pairing reads:
    named as ``bad_task_summary`` (the file, stem ``""``), with what the cross-check still uses; the stems
    it lists are kept in ``summary.misspelt`` so a ``status_conflict`` can say where its stem was listed."""
    for found, key in near_miss_keys(summary.data):
        summary.misspelt[found] = (key, _stems_of_success_list(summary.data[found]) or set())
        present = [k for k in _SUMMARY_KEYS if k in summary.data]
        uses = f"the cross-check uses {' and '.join(present)} only" if present else "nothing is cross-checked"
        summary.bad_entries.append(PairingReject(
            "", str(summary.path), "bad_task_summary",
            f"vio_result.json key {found!r} looks like a misspelling of {key!r} (misspelt? {found!r} for {key!r}): "
            f"the {len(summary.data[found])} {'entry' if len(summary.data[found]) == 1 else 'entries'} under it "
            f"{'is' if len(summary.data[found]) == 1 else 'are'} not read; {uses}; rename the key"))


def read_task_summary(root: Path) -> TaskSummary | None:
    """The task folder's ``vio_result.json``, or None when there is none; an unparseable file
    gives a summary with ``error`` set (pairing reports it and skips the cross-check), and so does one
    that parses but holds no list to cross-check (``error_code`` ``bad_task_summary``: an empty list,
    a misspelt key)."""
    path = root / "vio_result.json"
    if not path.is_file():
        return None
    summary = TaskSummary(path)
    try:
        summary.data = json.loads(status_text(path.read_bytes()))
    except (OSError, ValueError) as exc:
        summary.error = f"cannot parse vio_result.json: {type(exc).__name__}: {exc}"
        return summary
    summary.error = _layout_error(summary.data)
    if summary.error is not None:
        summary.error_code = "bad_task_summary"
    if isinstance(summary.data, dict):
        for key in ("success_mcap_files", "failed_mcap_files"):
            stems = _stems_of_success_list(summary.data.get(key), root, summary.bad_entries, key)
            if key == "success_mcap_files":
                summary.success = stems
            else:
                summary.failed = stems
        if summary.error is None:
            _near_miss_rejects(summary, root)
    return summary

