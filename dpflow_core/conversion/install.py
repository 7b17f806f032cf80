"""Installing outputs: put finished temporary files at their final names, never overwriting.

Takes temporary files beside the outputs; links each into place (``os.link`` fails when the name
exists), or keeps a backup first when asked, and removes what killed conversions left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dpflow_core.files import remove_stale_temporaries, temp_name
from dpflow_core.errors import ConversionError


def remove_stale(folder: Path) -> list[str]:
    """Remove the temporaries left in ``folder`` by runs that no longer run (a killed conversion's
    ``partial`` file and ``work`` folder, any stage's ``tmp``: :func:`dpflow_core.files.remove_stale_temporaries`,
    which keeps a live run's, PID reuse included). Returns the names removed."""
    return [t.path.name for t in remove_stale_temporaries(folder)]


def install_output(tmp: Path, final: Path, backup_to: Path | None) -> None:
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


def backup_name(path: Path, stamp: str) -> Path:
    """Where :func:`install_output` keeps the output it replaces: ``<stem>.bak-<stamp><suffix>`` beside it."""
    return path.with_name(f"{path.stem}.bak-{stamp}{path.suffix}")


def write_json_atomic(path: Path, doc: dict) -> Path:
    """Write ``doc`` as indented JSON to a ``partial`` temporary beside ``path`` (fsynced) and return the
    temporary's path; the caller installs it with :func:`install_output` once every output is ready."""
    tmp = path.with_name(temp_name(path.name, "partial", unique=False))
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp
