"""Installing outputs: put finished temporary files at their final names, never overwriting.

Takes temporary files beside the outputs; links each into place (``os.link`` fails when the name
exists), or keeps a backup first when asked, and removes what killed conversions left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from dpflow_core.files import pid_alive
from dpflow_core.errors import ConversionError


def _remove_stale(folder: Path, names: Iterable[str] | None = None) -> list[str]:
    """Remove ``.<name>.partial-<pid>`` files and ``.<name>.work-<pid>`` folders left in ``folder``
    by conversions that are no longer running (no process ``<pid>``), whatever output they were
    writing (``names`` None) or only for the given output names. A name whose process still
    runs is kept: it may be a conversion at work. Each removal is logged (warning) by name.

    Returns:
        The names removed.
    """
    import logging

    removed = []
    wanted = None if names is None else set(names)
    for entry in sorted(folder.glob(".*")):
        base, sep, pid = entry.name[1:].rpartition("-")
        stem, dot, kind = base.rpartition(".")
        if not (sep and dot and kind in ("partial", "work") and pid.isdigit()):
            continue
        if (wanted is not None and stem not in wanted) or pid_alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
        logging.getLogger("dpflow.conversion").warning(
            "removed %s in %s: left by conversion process %s, which is no longer running", entry.name, folder, pid)
    return removed


def _install(tmp: Path, final: Path, backup_to: Path | None) -> None:
    """Put ``tmp`` at ``final`` without ever overwriting: hard link (fails when ``final`` exists)
    then unlink ``tmp``. With ``backup_to``, an existing ``final`` is first linked there and
    then atomically replaced, so ``final`` is never missing."""
    if backup_to is not None and final.exists():
        os.link(final, backup_to)
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final)
    except FileExistsError as exc:
        raise ConversionError("output appeared while converting; it was left untouched", final, code="output_exists") from exc
    except OSError:
        # File systems without hard links: check, then rename (a narrow race instead of none).
        if final.exists():
            raise ConversionError("output exists; it was left untouched", final, code="output_exists")
        os.replace(tmp, final)
        return
    tmp.unlink()


def _backup_name(path: Path, stamp: str) -> Path:
    return path.with_name(f"{path.stem}.bak-{stamp}{path.suffix}")


def _write_json_atomic(path: Path, doc: dict) -> Path:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp
