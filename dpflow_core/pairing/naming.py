"""Which file belongs to which stem: Matrix Studio's naming rules for one task folder.

A recording is three files with one exact stem, directly in the task folder::

    <STEM>.mcap  <STEM>_vio.mcap  <STEM>_vio.json

``<STEM>_vio.mcap`` / ``<STEM>_vio.json`` belong to ``<STEM>``; any other ``<NAME>.mcap`` is
the raw recording of stem ``<NAME>``. Hidden (``.``-prefixed) files are temp files being
written and are ignored, unless their stem is only dots (:func:`dot_stem`), which is a bad
name rather than a temp file. ``.mcap`` files in subfolders belong to another task or run.

:func:`group_by_stem` applies these rules to a folder; the checks each group then goes
through are in :mod:`dpflow_core.pairing.checks`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dpflow_core.pairing.manifest import PairingReject

#: File name suffix of each role.
SUFFIX = {"raw_mcap": ".mcap", "vio_mcap": "_vio.mcap", "vio_json": "_vio.json"}

# A retry (``_retryN`` / ``-retryN``) or a file manager's copy (``NAME (N)``) of stem ``base``.
_RETRY = re.compile(r"^(?P<base>.+?)(?:[_-]retry\d+| \(\d+\))$")


def split_name(name: str) -> tuple[str, str] | None:
    """``(stem, role)`` of a Matrix Studio file name, or None for other files.

    ``role`` is ``raw_mcap``, ``vio_mcap`` or ``vio_json``; ``vio_result.json`` and
    hidden files (``.``-prefixed, e.g. temp files being written) give None.
    """
    if name.startswith(".") or name == "vio_result.json":
        return None
    for role in ("vio_mcap", "vio_json", "raw_mcap"):
        suffix = SUFFIX[role]
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], role
    return None


def rule_stems(files: dict[str, str | Path]) -> dict[str, str]:
    """The stem each file's name gives by the naming rules, ``{role: stem}``, for the files named by the rule of
    the role they fill (``<STEM>.mcap`` as ``raw_mcap``, ``<STEM>_vio.mcap`` as ``vio_mcap``, ``<STEM>_vio.json``
    as ``vio_json``); an explicit manifest may name its files freely, so a file named otherwise is left out.

    Args:
        files: path (or name) per role.
    """
    named = {}
    for role, path in files.items():
        got = split_name(Path(path).name)
        if got is not None and got[1] == role:
            named[role] = got[0]
    return named


def dot_stem(name: str) -> str | None:
    """The stem of a Matrix Studio file name whose stem is only dots (``..._vio.mcap``), else None.
    :func:`split_name` treats ``.``-prefixed names as hidden temp files; such a stem is neither."""
    for suffix in ("_vio.mcap", "_vio.json", ".mcap"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return stem if stem and set(stem) == {"."} else None
    return None


def retry_base(stem: str) -> str | None:
    """The stem a retry duplicate repeats: ``X`` for ``X_retry2``, ``X-retry2`` or ``X (2)``, else None."""
    match = _RETRY.match(stem)
    return match.group("base") if match else None


def inside(path: Path, root_resolved: Path) -> bool:
    """Whether ``path``, links resolved, lies inside the (resolved) task folder ``root_resolved``."""
    try:
        path.resolve().relative_to(root_resolved)
        return True
    except ValueError:
        return False


@dataclass
class Candidate:
    """The files of one stem, before any check.

    Attributes:
        stem: the stem; files: path per role present (``raw_mcap``, ``vio_mcap``, ``vio_json``).
        explicit: the files come from an explicit manifest (the naming rules were not applied).
    """

    stem: str
    files: dict[str, Path]
    explicit: bool = False


def group_by_stem(root: Path) -> tuple[dict[str, Candidate], list[PairingReject]]:
    """Group the files directly in ``root`` by stem; reject recordings in subfolders.

    Returns:
        (stem -> its :class:`Candidate`, rejects): ``other_task`` for each stem found in a
        subfolder (one per folder and stem), ``invalid_stem`` for a stem that is only dots.
    """
    groups: dict[str, Candidate] = {}
    rejects: list[PairingReject] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            split = dot_stem(entry.name)
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
        groups.setdefault(stem, Candidate(stem, {})).files[role] = entry
    return groups, rejects

