"""Lineage metadata: from a checkpoint or an evaluation back to the exact input recordings.

The dataset's ``dataset.json`` sidecar (written by conversion, formats.md section 2)
lists the pairing manifest(s) and every input file with its size and SHA-256 (a
curated, trimmed copy with the recording it was cut from and the spans it kept);
:func:`dataset_lineage` turns it into materialization metadata (``lineage/...``
entries), so the asset page of a checkpoint shows the training run, the dataset
SHA-256 and the recordings it came from without following any other link.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg

from dpflow_core.conversion import sidecar_path_for

#: Roles of a recording's files, in the order shown.
_ROLES = ("raw_mcap", "vio_mcap", "vio_json")


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _spans(spans: Any) -> str:
    return ", ".join(f"{a:.2f}-{b:.2f} s" for a, b in spans or []) or "none"


def recordings_table(inputs: dict[str, Any]) -> str:
    """Markdown table of the input recordings: stem, role, file, size (bytes), full SHA-256.

    A file of the recordings root shows its name. A trimmed copy (an episode with ``derived_from``,
    :func:`dpflow_core.conversion.metadata.derived_from`) is not that root's file: its row says
    ``<role> (trimmed copy)`` with the copy's full path and hash, and the next row ``<role> source``
    the recording it was cut from (full path, size, hash) with the spans the copy kept and cut
    (seconds from the source's first camera frame): only the kept spans trained.
    """
    rows = ["| stem | role | file | bytes | sha256 |", "|---|---|---|---|---|"]
    for episode in inputs.get("episodes", []):
        stem, files = _md(episode.get("stem", "")), episode.get("files", {})
        source = episode.get("derived_from") or {}
        for role in [r for r in _ROLES if r in files] + sorted(set(files) - set(_ROLES)):
            entry = files[role] or {}
            path = Path(str(entry.get("path", "")))
            if role != source.get("role"):
                rows.append(f"| {stem} | {role} | {_md(path.name)} | {entry.get('size_bytes', '')} "
                            f"| `{entry.get('sha256', '')}` |")
                continue
            rows.append(f"| {stem} | {role} (trimmed copy, trained) | {_md(path)} | {entry.get('size_bytes', '')} "
                        f"| `{entry.get('sha256', '')}` |")
            rows.append(f"| {stem} | {role} source ({_md(source.get('by', ''))}: kept {_spans(source.get('kept_s'))}; "
                        f"cut {_spans(source.get('cut_s'))}) | {_md(source.get('path', ''))} "
                        f"| {source.get('size_bytes') or ''} | `{source.get('sha256', '')}` |")
    return "\n".join(rows)


def dataset_lineage(dataset_path: str | None) -> dict[str, Any]:
    """``lineage/...`` metadata of the dataset at ``dataset_path`` read from its sidecar.

    Entries: ``lineage/dataset_path``, ``lineage/dataset_sha256``, ``lineage/manifest``,
    ``lineage/recordings_root``, ``lineage/episodes`` and ``lineage/recordings`` (the
    table of :func:`recordings_table`); ``lineage/trimmed_copies`` (how many inputs are trimmed
    copies from outside that root, listed as such in the table) when there are any. A missing or unreadable sidecar gives the
    dataset path and a line saying why the rest is absent (never a failure: the
    product exists, only its record is incomplete).
    """
    if not dataset_path:
        return {"lineage/recordings": dg.MetadataValue.md("No local dataset recorded for this run.")}
    sidecar = sidecar_path_for(dataset_path)
    out: dict[str, Any] = {"lineage/dataset_path": dg.MetadataValue.path(str(dataset_path))}
    try:
        meta = json.loads(sidecar.read_text())
        inputs = meta["inputs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        out["lineage/recordings"] = dg.MetadataValue.md(f"Dataset sidecar {_md(sidecar)} unreadable: {_md(exc)}")
        return out
    manifests = [str(m) for m in inputs.get("manifests", [])]
    out.update({
        "lineage/dataset_sha256": str(meta.get("sha256", "")),
        "lineage/dataset_sidecar": dg.MetadataValue.path(str(sidecar)),
        "lineage/manifest": dg.MetadataValue.path(manifests[0]) if len(manifests) == 1 else ", ".join(manifests),
        "lineage/recordings_root": dg.MetadataValue.path(str(inputs.get("root", ""))),
        "lineage/episodes": len(inputs.get("episodes", [])),
        "lineage/recordings": dg.MetadataValue.md(recordings_table(inputs)),
    })
    copies = sum(bool(e.get("derived_from")) for e in inputs.get("episodes", []))
    if copies:
        out["lineage/trimmed_copies"] = copies
    return out
