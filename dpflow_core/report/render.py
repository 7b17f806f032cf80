"""The quality report's renderings: ``report.html`` with ``quality.json``, and the same table as Markdown.

Takes the :class:`~dpflow_core.report.quality.EpisodeQuality` rows (and the manifest's rejects); gives
the files of :func:`write_report` (temp name, then rename) or a Markdown string for a Dagster materialization.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.errors import DpflowError
from dpflow_core.files import display_name, os_errors_named, remove_stale_temporaries, write_text_atomic
from dpflow_core.offsets import DEFAULT_OPTIONS as OFFSET_OPTIONS
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap
from dpflow_core.report.quality import (
    OUTLIER_FLOORS, OUTLIER_Z, EpisodeQuality, episode_quality, manifest_data,
)

@dataclass(frozen=True)
class ReportResult:
    """What :func:`write_report` wrote.

    Attributes:
        html_path: ``report.html``.
        json_path: ``quality.json`` (task, per-episode measurements, rejected entries).
        preview_dir: folder of the ``<stem>.png`` previews.
        episodes: the measurements, in manifest order.
        task: the manifest's task name.
        unreadable: accepted entries that could not be measured (file gone, unreadable,
            damaged since pairing, unsafe stem): ``{"stem", "path", "code", "reason",
            "stage": "report"}``; they are also listed as rejected in the report.
    """

    html_path: Path
    json_path: Path
    preview_dir: Path
    episodes: list[EpisodeQuality]
    task: str
    unreadable: list[dict] = field(default_factory=list)

    @property
    def outliers(self) -> list[str]:
        """Stems of the flagged episodes."""
        return [e.stem for e in self.episodes if e.is_outlier]


# ---------------------------------------------------------------- tables and report

_COLUMNS = (
    "episode", "duration s", "camera/pose/gripper Hz", "score p05 / median", "valid %",
    "pose gaps (n, longest s)", "frames trimmed/dropped/undecodable", "gripper mm", "camera / IMU offset ms",
    "outlier",
)


def _offset_cell(estimate: Mapping[str, Any]) -> str:
    """An offset in ms with its peak R^2, ``not measurable`` or ``-`` (no such stream / not measured)."""
    if estimate.get("status") == "measured":
        return f"{1e3 * estimate['offset_s']:+.1f} (R\u00b2 {estimate['r2']:.2f})"
    return "not measurable" if estimate.get("status") == "not_measurable" else "-"


def quality_figures(episodes: Sequence[EpisodeQuality]) -> dict[str, int | float]:
    """The task's headline figures: ``outliers`` (episodes flagged), ``total_duration_s`` (s, summed) and
    ``median_vio_score`` (the upper median of the episodes' median VIO scores; 0.0 without episodes)."""
    scores = sorted(e.score_median for e in episodes)
    return {
        "outliers": sum(e.is_outlier for e in episodes),
        "total_duration_s": float(sum(e.duration_s for e in episodes)),
        "median_vio_score": float(scores[len(scores) // 2]) if scores else 0.0,
    }


def report_dir_for(workdir: str | Path, manifest_path: str | Path) -> Path:
    """Where the quality report of a saved manifest goes: ``<workdir>/reports/<manifest file stem>``
    (named like the content-addressed manifest, ``<task>-<hash12>``)."""
    return Path(workdir) / "reports" / Path(manifest_path).stem


def _row(e: EpisodeQuality) -> list[str]:
    undec = "-" if e.frames_undecodable is None else str(e.frames_undecodable)
    return [
        e.stem,
        f"{e.duration_s:.2f}",
        f"{e.camera_hz:.1f} / {e.pose_hz:.1f} / {e.gripper_hz:.1f}",
        f"{e.score_p05:.2f} / {e.score_median:.2f}",
        f"{100 * e.valid_fraction:.1f}",
        f"{len(e.pose_gaps)}, {e.pose_gap_longest_s:.2f}",
        f"{e.frames_trimmed} / {e.frames_dropped} / {undec}",
        f"{1e3 * e.gripper_min_m:.1f}-{1e3 * e.gripper_max_m:.1f}",
        f"{_offset_cell(e.camera_offset)} / {_offset_cell(e.imu_offset)}",
        "; ".join(e.outlier_reasons) if e.outlier_reasons else "",
    ]


def markdown_table(episodes: Sequence[EpisodeQuality], image_links: Mapping[str, str] | None = None) -> str:
    """The per-episode table as GitHub-flavoured Markdown.

    Args:
        episodes: the measurements.
        image_links: stem -> URL or path of its preview; adds a ``preview``
            column with ``![stem](link)`` when given.
    """
    cols = list(_COLUMNS) + (["preview"] if image_links is not None else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for e in episodes:
        cells = [c.replace("|", "\\|") for c in _row(e)]
        if e.is_outlier:
            cells[-1] = f"**{cells[-1]}**"
        if image_links is not None:
            link = image_links.get(e.stem)
            cells.append(f"![{e.stem}]({link})" if link else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _html(task: str, manifest_label: str, episodes: Sequence[EpisodeQuality], rejected: Sequence[Any], out_dir: Path) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in (*_COLUMNS, "preview"))
    rows = []
    for e in episodes:
        cells = "".join(f"<td>{esc(c)}</td>" for c in _row(e))
        img = ""
        if e.preview_png:
            rel = os.path.relpath(e.preview_png, out_dir)
            img = f'<a href="{esc(rel)}"><img src="{esc(rel)}" alt="{esc(e.stem)}" width="450"></a>'
        cls = ' class="outlier"' if e.is_outlier else ""
        rows.append(f"<tr{cls}>{cells}<td>{img}</td></tr>")
    rej = []
    for r in rejected:
        if isinstance(r, Mapping):
            stem = r.get("stem") or r.get("path") or ""
            reason = r.get("reason") or r.get("reasons") or json.dumps(r, default=str)
        else:
            stem, reason = "", r
        rej.append(f"<tr><td>{esc(str(stem))}</td><td>{esc(str(reason))}</td></tr>")
    n_out = sum(e.is_outlier for e in episodes)
    total = sum(e.duration_s for e in episodes)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dpflow episode quality: {esc(task)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: middle; }}
tr.outlier td {{ background: #fde8e8; }}
</style></head><body>
<h1>Episode quality: {esc(task)}</h1>
<p>Manifest: <code>{esc(manifest_label)}</code><br>
{len(episodes)} accepted episodes, {total:.1f} s in all; {len(rejected)} rejected; {n_out} flagged as outliers
(|x &minus; median| &gt; {OUTLIER_Z} &times; max(1.4826 MAD, floor) on duration, median VIO score, pose_valid gaps;
camera or IMU offset more than {1e3 * OFFSET_OPTIONS.flag_threshold_s:g} ms from the task median).</p>
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Rejected</h2>
<table><thead><tr><th>stem</th><th>reason</th></tr></thead><tbody>
{chr(10).join(rej) if rej else '<tr><td colspan="2">none</td></tr>'}
</tbody></table>
</body></html>
"""


def write_report(
    manifest: str | Path | Mapping[str, Any],
    out_dir: str | Path,
    overwrite: bool = False,
    topics: TopicMap = DAS_DEFAULT,
) -> ReportResult:
    """Measure a manifest's accepted episodes and write an HTML quality report.

    Writes ``out_dir/report.html``, ``out_dir/quality.json`` and
    ``out_dir/previews/<stem>.png`` (each to a temporary name, then renamed).

    Args:
        manifest: manifest JSON path or dict (see :func:`episode_quality`).
        out_dir: the report folder (created if missing).
        overwrite: replace an existing report in ``out_dir``.
        topics: topic names of the recordings.

    Raises:
        DpflowError: (code ``output_exists``) ``out_dir`` already holds a report
            and ``overwrite`` is false.
        PairingError, RecordingError: as :func:`episode_quality`.
        StorageError: ``out_dir`` cannot be written (disk full, permission denied, read-only file system),
            naming it; the files this call made are removed (with ``overwrite``, one it had replaced stays new).
    """
    out_dir = Path(out_dir)
    html_path, json_path = out_dir / "report.html", out_dir / "quality.json"
    if not overwrite and (html_path.exists() or json_path.exists()):
        raise DpflowError("a report already exists here; pass --overwrite (overwrite=True from Python) to replace it", out_dir, code="output_exists")
    data, _ = manifest_data(manifest)
    made_dir = not out_dir.exists()
    before = _report_files(out_dir)
    try:
        with os_errors_named(out_dir, "writing the report"):
            return _write_report(manifest, data, out_dir, topics)
    except BaseException:
        # A full disk or an unwritable folder: what this call wrote goes, what was there stays.
        for p in sorted(set(_report_files(out_dir)) - set(before), reverse=True) + ([out_dir] if made_dir else []):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() else p.unlink()
        raise


def _report_files(out_dir: Path) -> list[Path]:
    """The report's own files and the previews folder, as they are now (none when ``out_dir`` is missing)."""
    found = [p for p in (out_dir / "report.html", out_dir / "quality.json", out_dir / "previews") if p.exists()]
    if (out_dir / "previews").is_dir():
        found += sorted((out_dir / "previews").iterdir())
    return found


def _write_report(manifest, data: Mapping[str, Any], out_dir: Path, topics: TopicMap) -> ReportResult:
    html_path, json_path, preview_dir = out_dir / "report.html", out_dir / "quality.json", out_dir / "previews"
    out_dir.mkdir(parents=True, exist_ok=True)
    for folder in (out_dir, preview_dir):  # a killed report's temporaries
        remove_stale_temporaries(folder)
    unreadable: list[dict] = []
    episodes = episode_quality(data if isinstance(manifest, Mapping) else manifest, preview_dir, topics, unreadable=unreadable)
    task = str(data.get("task", ""))
    rejected = list(data.get("rejected") or []) + unreadable
    label = "(in memory)" if isinstance(manifest, Mapping) else str(Path(manifest).resolve())
    summary = {
        "task": task,
        "manifest": label,
        "outlier_rule": {"z": OUTLIER_Z, "floors": OUTLIER_FLOORS},
        "episodes": [e.to_dict() for e in episodes],
        "rejected": rejected,
    }
    # A file name that is not UTF-8 (a hand-made manifest's reject) is shown escaped, never a traceback.
    write_text_atomic(json_path, json.dumps(summary, indent=2, default=_json_default))
    write_text_atomic(html_path, display_name(_html(task, label, episodes, rejected, out_dir)))
    return ReportResult(html_path=html_path, json_path=json_path, preview_dir=preview_dir, episodes=episodes, task=task,
                        unreadable=unreadable)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)
