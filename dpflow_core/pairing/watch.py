"""Incremental scan of a Matrix Studio output root for finished, stable recordings.

The recordings sensor (:mod:`dpflow_dagster.sensors`) calls :func:`scan_tick` once per
tick. Its cost must not grow with the recordings already handled: a tick over a root
whose task folders are all unchanged stats each task folder once and reads nothing else.

A recording (``<STEM>.mcap``, ``<STEM>_vio.mcap``, ``<STEM>_vio.json``) is *ready* when
its three files are present, its status file holds a final status (success, failed, or
a layout pairing reports as unknown: :func:`dpflow_core.pairing.status.parse_vio_status`) and
its files' sizes and mtimes were the same at the previous full scan of its folder: files
still being written or copied are never requested.

How a folder is skipped, and why that is safe:

- *Directory mtime.* Creating, deleting or renaming a file changes its folder's
  mtime. A folder whose mtime equals the one recorded at its last full scan, with no
  recording waiting for its second look, is not listed.
- *mtime granularity.* A file added in the same clock granule as the folder's recorded
  mtime (file systems keep 1 ns to 2 s; Linux stamps with a coarse clock) leaves the
  folder's mtime unchanged. So, as git does for its index ("racy git"), a folder
  mtime less than ``RACY_WINDOW_NS`` older than the scan that read it is not
  trusted: the folder is scanned again on the next tick.
- *Files changed in place.* Rewriting a file (``open(..., "w")``) changes the file's
  mtime but not its folder's. Complete recordings whose status is not final yet
  (``running``, half-written JSON) are *watched*: their three files are statted by name
  every tick and a change rescans the folder. A finished recording rewritten in place
  (VIO re-run over the same output) is found by the *audit*: each tick also fully scans
  unchanged-looking folders, least recently scanned first, as long as their files
  (counted at their last scan) fit in ``audit_files`` stat calls. A small root is
  therefore re-verified on every tick, a large one round-robin at a bounded cost per
  tick; a folder larger than the whole budget is scanned alone once its last scan is
  ``audit_interval_s`` old.

A full scan stats every recording file (one ``stat`` each, from ``os.scandir``) and
parses only the ``_vio.json`` of stems newer than the folder's requested ones, and not
even those when they are unchanged since the previous scan.

Cursor: per task folder a :class:`FolderState`, whose size does not depend on how many
recordings the folder holds: the newest mtime already requested, the folder mtime,
and the recordings waiting for their second look as one SHA-256 digest (plus their
count and newest mtime), never a list of every stem. Only watched (in-flight)
recordings and the first ``MAX_WAITING_NAMES`` waiting names are listed by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpflow_core.pairing.manifest import ROLES
from dpflow_core.pairing.naming import split_name
from dpflow_core.pairing.status import read_vio_status

#: A folder mtime younger than this at the time it was read is not trusted (ns): 2 s covers FAT's granularity.
RACY_WINDOW_NS = 2_000_000_000
#: Default stat calls per tick spent on full scans (audits) of unchanged-looking folders.
DEFAULT_AUDIT_FILES = 1000
#: Default age (s) after which a folder larger than the audit budget is scanned alone.
DEFAULT_AUDIT_INTERVAL_S = 600.0
#: Waiting stems named in the cursor per folder (for the skip reason); the rest are counted.
MAX_WAITING_NAMES = 10
_FINAL = ("success", "failed", "unknown")


@dataclass
class FolderState:
    """What the cursor keeps of one task folder between ticks (sizes in bytes, times in s or ns as named).

    Attributes:
        dir_mtime_ns: the folder's mtime at its last full scan, or None when it was too
            recent to trust (``RACY_WINDOW_NS``) or there was no scan yet.
        max_mtime_ns: newest file mtime (ns) of the stems already requested; only stems
            with a newer file are looked at again (``max_mtime``: the same in s).
        pending_digest: SHA-256 (hex) over the final stems seen at the last full scan and
            not requested yet (name, role, size, mtime_ns of each file); "" when none.
        pending_n: how many stems that digest covers.
        pending_upto_ns: newest file mtime among them (ns).
        watch: complete stems whose status was not final: stem -> ``[size_bytes, mtime_ns]``
            of their files (sum, max); statted by name every tick.
        waiting_n: stems waiting at the last full scan (incomplete, not final, or seen once).
        waiting_names: the first ``MAX_WAITING_NAMES`` of them, sorted.
        scanned_at: wall-clock time (s) of the last full scan.
        n_files: recording files found at the last full scan (what auditing it costs).
    """

    dir_mtime_ns: int | None = None
    max_mtime_ns: int = 0
    pending_digest: str = ""
    pending_n: int = 0
    pending_upto_ns: int = 0
    watch: dict[str, list[int]] = field(default_factory=dict)
    waiting_n: int = 0
    waiting_names: list[str] = field(default_factory=list)
    scanned_at: float = 0.0
    n_files: int = 0

    @property
    def max_mtime(self) -> float:
        return self.max_mtime_ns / 1e9

    @classmethod
    def from_json(cls, data: Mapping) -> FolderState:
        """Parse one folder's cursor entry.

        Raises:
            ValueError, TypeError, KeyError, AttributeError: for a malformed entry.
        """
        d = dict(data)
        dir_mtime = d.get("dir_mtime_ns")
        return cls(
            dir_mtime_ns=None if dir_mtime is None else int(dir_mtime),
            max_mtime_ns=int(d.get("max_mtime_ns", 0)),
            pending_digest=str(d.get("pending_digest", "")),
            pending_n=int(d.get("pending_n", 0)),
            pending_upto_ns=int(d.get("pending_upto_ns", 0)),
            watch={str(k): [int(v[0]), int(v[1])] for k, v in dict(d.get("watch", {})).items()},
            waiting_n=int(d.get("waiting_n", 0)),
            waiting_names=[str(n) for n in d.get("waiting_names", [])],
            scanned_at=float(d.get("scanned_at", 0.0)),
            n_files=int(d.get("n_files", 0)),
        )


@dataclass(frozen=True)
class ReadyStem:
    """A finished recording to request: its stem and, per role, ``(size_bytes, mtime_s)`` of its file."""

    stem: str
    files: dict[str, tuple[int, float]]

    @property
    def mtime(self) -> float:
        return max(m for _, m in self.files.values())


@dataclass
class FolderResult:
    """One task folder's outcome of a tick.

    Attributes:
        ready: recordings finished and unchanged since the previous full scan, to request now.
        state: the folder's new cursor state.
        scanned: whether the folder was listed (a full scan) this tick.
        files_statted: ``stat`` calls made on recording files.
        json_parsed: ``_vio.json`` files read and parsed.
    """

    ready: list[ReadyStem]
    state: FolderState
    scanned: bool
    files_statted: int = 0
    json_parsed: int = 0


def _stem_digest(stems: list[tuple[str, dict[str, tuple[int, int]]]]) -> str:
    body = [[stem, sorted([role, size, mtime_ns] for role, (size, mtime_ns) in files.items())] for stem, files in stems]
    return hashlib.sha256(json.dumps(sorted(body)).encode()).hexdigest()


def _watch_changed(folder: Path, watch: Mapping[str, list[int]]) -> tuple[bool, int]:
    """(whether any watched stem's files differ from their recorded size and mtime, stat calls made)."""
    calls = 0
    for stem, (size, mtime_ns) in watch.items():
        total, newest = 0, 0
        for name in (f"{stem}.mcap", f"{stem}_vio.mcap", f"{stem}_vio.json"):
            calls += 1
            try:
                st = os.stat(folder / name)
            except OSError:
                return True, calls
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
        if [total, newest] != [size, mtime_ns]:
            return True, calls
    return False, calls


def scan_folder(folder: Path, state: FolderState, *, now_ns: int | None = None) -> FolderResult:
    """Full scan of one task folder: list it, stat its recording files, decide what is ready.

    Args:
        folder: the task folder (recordings directly inside).
        state: its state from the previous tick (``FolderState()`` the first time).
        now_ns: the wall clock (``time.time_ns()``), read before the folder's mtime.

    Returns:
        The stems to request and the folder's new state. A folder that has vanished
        gives no stem and a fresh state.
    """
    now_ns = time.time_ns() if now_ns is None else now_ns
    try:
        dir_mtime_ns = os.stat(folder).st_mtime_ns
        entries = list(os.scandir(folder))
    except OSError:
        return FolderResult([], FolderState(), scanned=True)
    found: dict[str, dict[str, tuple[int, int]]] = {}
    calls = 0
    for entry in entries:
        split = split_name(entry.name)
        if split is None or not entry.is_file():
            continue
        calls += 1
        try:
            st = entry.stat()
        except OSError:
            continue
        found.setdefault(split[0], {})[split[1]] = (st.st_size, st.st_mtime_ns)

    max_mtime_ns = state.max_mtime_ns
    complete, waiting = {}, []
    for stem, files in found.items():
        if max(m for _, m in files.values()) <= max_mtime_ns:
            continue  # requested before (or copied in with an older mtime: see the module docstring)
        if all(r in files for r in ROLES):
            complete[stem] = files
        else:
            waiting.append(stem)

    # The final stems of the previous scan, unchanged: exactly the stems not newer than its newest one.
    # (Watched stems, unchanged, are not final: they were not in that digest.)
    seen_before = {
        s: f
        for s, f in complete.items()
        if max(m for _, m in f.values()) <= state.pending_upto_ns
        and state.watch.get(s) != [sum(size for size, _ in f.values()), max(m for _, m in f.values())]
    }
    ready_stems: set[str] = set()
    if state.pending_n and len(seen_before) == state.pending_n:
        if _stem_digest(sorted(seen_before.items())) == state.pending_digest:
            ready_stems = set(seen_before)
    parsed = 0
    final, watch = {}, {}
    for stem, files in complete.items():
        if stem in ready_stems:
            continue
        size, mtime_ns = sum(s for s, _ in files.values()), max(m for _, m in files.values())
        if state.watch.get(stem) == [size, mtime_ns]:
            status = "running"  # unchanged since it was found not final: no need to read it again
        else:
            status = read_vio_status(folder / f"{stem}_vio.json")
            parsed += 1
        if status in _FINAL:
            final[stem] = (files, status)
        else:
            watch[stem] = [size, mtime_ns]

    ready = [
        ReadyStem(stem, {r: (size, m / 1e9) for r, (size, m) in complete[stem].items()}) for stem in sorted(ready_stems)
    ]
    for stem in ready_stems:
        max_mtime_ns = max(max_mtime_ns, max(m for _, m in complete[stem].values()))
    waiting_all = sorted(waiting + list(watch) + list(final))
    new = FolderState(
        dir_mtime_ns=dir_mtime_ns if now_ns - dir_mtime_ns > RACY_WINDOW_NS else None,
        max_mtime_ns=max_mtime_ns,
        pending_digest=_stem_digest(sorted((s, f) for s, (f, _) in final.items())) if final else "",
        pending_n=len(final),
        pending_upto_ns=max((max(m for _, m in f.values()) for f, _ in final.values()), default=0),
        watch=watch,
        waiting_n=len(waiting_all),
        waiting_names=waiting_all[:MAX_WAITING_NAMES],
        scanned_at=now_ns / 1e9,
        n_files=calls,
    )
    return FolderResult(ready, new, scanned=True, files_statted=calls, json_parsed=parsed)


@dataclass
class TickResult:
    """Outcome of :func:`scan_tick` over every task folder.

    Attributes:
        folders: task -> its :class:`FolderResult` (every folder, scanned or not).
        audited: the tasks whose unchanged-looking folders were fully scanned as the audit.
    """

    folders: dict[str, FolderResult]
    audited: list[str] = field(default_factory=list)

    @property
    def scanned(self) -> int:
        return sum(r.scanned for r in self.folders.values())

    @property
    def files_statted(self) -> int:
        return sum(r.files_statted for r in self.folders.values())

    @property
    def json_parsed(self) -> int:
        return sum(r.json_parsed for r in self.folders.values())


def scan_tick(
    folders: Mapping[str, Path],
    states: Mapping[str, FolderState],
    *,
    audit_files: int = DEFAULT_AUDIT_FILES,
    audit_interval_s: float = DEFAULT_AUDIT_INTERVAL_S,
    now_ns: int | None = None,
) -> TickResult:
    """One sensor tick over the task folders: skip the unchanged ones, fully scan the others.

    Args:
        folders: task name -> task folder (:func:`dpflow_core.pairing.tasks.task_folders`).
        states: the cursor's state per task; a task missing here is scanned.
        audit_files: stat calls this tick may spend on full scans of unchanged-looking
            folders (the audit; see the module docstring); 0 audits only by age.
        audit_interval_s: age (s) of its last scan after which a folder too large for
            ``audit_files`` is scanned alone.
        now_ns: the wall clock in ns (``time.time_ns()`` when None).

    Returns:
        Per task, what is ready and the new state; states of tasks whose folders are gone
        are dropped.

    Raises:
        ValueError: a negative ``audit_files`` or ``audit_interval_s``.
    """
    if audit_files < 0 or audit_interval_s < 0:
        raise ValueError(f"audit_files and audit_interval_s must be >= 0, got {audit_files}, {audit_interval_s}")
    now_ns = time.time_ns() if now_ns is None else now_ns
    out: dict[str, FolderResult] = {}
    quiet: list[str] = []
    for task, folder in folders.items():
        state = states.get(task)
        if state is None or state.dir_mtime_ns is None or state.pending_n:
            out[task] = scan_folder(folder, state or FolderState(), now_ns=now_ns)
            continue
        try:
            dir_mtime_ns = os.stat(folder).st_mtime_ns
        except OSError:
            continue
        changed, calls = (True, 0) if dir_mtime_ns != state.dir_mtime_ns else _watch_changed(folder, state.watch)
        if changed:
            result = scan_folder(folder, state, now_ns=now_ns)
            result.files_statted += calls
            out[task] = result
        else:
            out[task] = FolderResult([], state, scanned=False, files_statted=calls)
            quiet.append(task)
    audited, budget = [], audit_files
    for task in sorted(quiet, key=lambda t: (out[t].state.scanned_at, t)):
        state = out[task].state
        if state.n_files > budget and not (
            not audited and now_ns / 1e9 - state.scanned_at >= audit_interval_s
        ):
            break
        budget -= state.n_files
        calls = out[task].files_statted
        out[task] = scan_folder(folders[task], state, now_ns=now_ns)
        out[task].files_statted += calls
        audited.append(task)
    return TickResult(out, audited)


def states_to_json(states: Mapping[str, FolderState]) -> dict:
    """The cursor document: ``{"version": 2, "tasks": {task: FolderState fields}}``."""
    return {"version": 2, "tasks": {task: asdict(s) for task, s in sorted(states.items())}}


def states_from_json(data: Mapping) -> dict[str, FolderState]:
    """Inverse of :func:`states_to_json`.

    Raises:
        ValueError: not a version-2 cursor document, or a malformed entry (also TypeError,
            KeyError, AttributeError from the entry itself).
    """
    if not isinstance(data, Mapping) or data.get("version") != 2:
        raise ValueError("not a version-2 recordings cursor")
    return {str(task): FolderState.from_json(s) for task, s in dict(data.get("tasks", {})).items()}
