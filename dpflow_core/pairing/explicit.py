"""The explicit pairing manifest: the user's own list of triples, for naming schemes that differ.

When a Matrix Studio version names its files differently, the pairing comes from a JSON file
``{"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}, ...]}`` (a bare list of entries is
also read), with paths relative to the task folder (absolute ones must lie inside it). Each
entry becomes a :class:`~dpflow_core.pairing.naming.Candidate` that goes through every check
of :mod:`dpflow_core.pairing.checks` except the folder naming rules. An entry without a stem or
a file is ``invalid_manifest_entry``, an unsafe stem ``invalid_stem``, a repeated stem
``duplicate_stem`` (the first entry is used).
"""

from __future__ import annotations

import json
from pathlib import Path

from dpflow_core.errors import InvalidNameError, PairingError
from dpflow_core.names import validate_name
from dpflow_core.pairing.manifest import ROLES, PairingReject
from dpflow_core.pairing.naming import Candidate


def read_explicit(manifest_path: Path, root: Path) -> tuple[list[Candidate], list[PairingReject]]:
    """Read an explicit pairing manifest: {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}]}.

    Paths are relative to ``root`` (absolute ones must lie inside it: checked later, as
    ``path_escapes_root``).

    Returns:
        (the candidates in file order, the entries rejected).

    Raises:
        PairingError: the file is missing (code ``missing_manifest``), not JSON or not a list
            of episodes (code ``bad_manifest``).
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
    candidates: list[Candidate] = []
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
        candidates.append(Candidate(stem, {r: root / entry[r] for r in ROLES}, explicit=True))
    return candidates, rejects
