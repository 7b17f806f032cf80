"""Assets of the recordings stage: ``paired_episodes`` (and the sensor and job that request it).

``paired_episodes`` wraps :func:`dpflow_core.pairing.pair_recordings` for the
task folder of its partition (:func:`dpflow_dagster.partitions.task_folder`) and
shows the episode quality table of :mod:`dpflow_core.report` on the
materialization: the report (``report.html``, ``quality.json``, a preview PNG per
episode) goes to ``<output_dir>/reports/<task>-<hash12>/``, named like the
content-addressed manifest ``<output_dir>/manifests/<task>-<hash12>.json``, and
the table shows small JPEG thumbnails of the previews inline. Its value is a
:class:`dpflow_core.pairing.PairedEpisodes`.
"""

from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import Field

from dpflow_core.errors import DpflowError
from dpflow_core.pairing import MANIFEST_VERSION, Manifest, PairedEpisodes, pair_recordings, save_manifest
from dpflow_core.report import (
    EpisodeQuality, episode_quality, markdown_table, quality_figures, report_dir_for, thumbnail_data_uri, write_report,
)
from dpflow_dagster.partitions import OWNERS, recordings_root, task_folder, task_partitions
from dpflow_core.files import default_workdir
from dpflow_core.view import view_command
from dpflow_dagster.sensors import paired_episodes_job, recordings_sensor


class PairedEpisodesConfig(dg.Config):
    """Where the recordings are and where the manifest goes."""

    root: Optional[str] = Field(
        default=None,
        description="Matrix Studio output root holding the task folders (the partition is the task folder's name), "
        "or the task folder itself; default $DPFLOW_RECORDINGS_ROOT, else <cwd>/outputs/recordings.",
    )
    output_dir: Optional[str] = Field(
        default=None,
        description="Work folder; the manifest goes to <output_dir>/manifests/, the quality report to "
        "<output_dir>/reports/. Default $DPFLOW_WORKDIR, else <cwd>/outputs.",
    )
    task: Optional[str] = Field(default=None, description="Task name; default from vio_result.json, else the folder name.")
    explicit_manifest: Optional[str] = Field(
        default=None, description='Explicit pairing JSON {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}]}.'
    )
    quality: bool = Field(
        default=True, description="Measure each accepted episode (duration, rates, VIO score, pose gaps) and show the table."
    )
    previews: bool = Field(
        default=True, description="Draw a preview PNG per episode (frames, trajectory, gripper) in the report folder."
    )
    inline_previews: int = Field(
        default=12, description="Episodes whose preview thumbnail is shown inline in the table (the rest: files only)."
    )
    thumbnail_width: int = Field(default=360, description="Width in pixels of the inline thumbnails (JPEG).")


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rejects_table(manifest: Manifest) -> str:
    """Markdown table of the rejects: stem, code, reason."""
    rows = ["| stem | code | reason |", "|---|---|---|"]
    rows += [f"| {_md(r.stem)} | {_md(r.code)} | {_md(r.reason)} |" for r in manifest.rejected]
    return "\n".join(rows) if manifest.rejected else "No rejects."


def accepted_table(manifest: Manifest) -> str:
    """Markdown table of the accepted stems with ``_vio.mcap`` SHA-256 prefixes and key figures."""
    rows = ["| stem | vio_mcap sha256 | raw_mcap bytes | overlap s | warnings |", "|---|---|---|---|---|"]
    for a in manifest.accepted:
        warnings = sorted({w["code"] for w in a.validation.get("warnings", [])})
        # The raw .mcap is not hashed (conversion never reads it): its size identifies it here.
        rows.append(
            f"| {_md(a.stem)} | `{a.files['vio_mcap'].sha256[:12]}` | {a.files['raw_mcap'].size_bytes} "
            f"| {a.validation.get('overlap_s')} | {_md(', '.join(warnings)) or '-'} |"
        )
    return "\n".join(rows) if manifest.accepted else "No accepted episodes."


def _quality_metadata(
    context: dg.AssetExecutionContext, config: PairedEpisodesConfig, manifest_path: Path, output_dir: Path
) -> dict:
    """Episode quality table (with thumbnails) and figures; a measurement failure is reported, not fatal."""
    report_dir = report_dir_for(output_dir, manifest_path)
    try:
        if config.previews:
            report = write_report(manifest_path, report_dir, overwrite=True)  # derived from the same hashed files
            episodes: list[EpisodeQuality] = report.episodes
        else:
            report, episodes = None, episode_quality(manifest_path)
    except DpflowError as exc:
        context.log.warning(f"episode quality not measured: {exc}")
        return {"quality": dg.MetadataValue.md(f"Not measured: {_md(exc)}")}
    links = None
    if report is not None:
        links = {
            e.stem: thumbnail_data_uri(e.preview_png, config.thumbnail_width) if i < config.inline_previews else ""
            for i, e in enumerate(episodes) if e.preview_png
        }
    meta: dict = {"quality": dg.MetadataValue.md(markdown_table(episodes, links)), **quality_figures(episodes)}
    meta["view_command"] = view_command(Path(episodes[0].vio_mcap).parent) if episodes else ""  # dpflow view: Rerun
    if report is not None:
        meta["report"] = dg.MetadataValue.path(str(report.html_path))
        meta["previews"] = dg.MetadataValue.path(str(report.preview_dir))
    return meta


@dg.asset(
    group_name="dataset",
    kinds={"mcap"},
    owners=OWNERS,
    code_version=f"pairing-{MANIFEST_VERSION}",
    partitions_def=task_partitions,
    description=(
        "Exact <STEM>.mcap + <STEM>_vio.mcap + <STEM>_vio.json triples of the partition's Matrix Studio task folder: "
        "status success, non-empty, valid MCAP; every other file listed as rejected with a reason. "
        "Writes a content-addressed manifest JSON (files with SHA-256, validation figures) and the episode quality "
        "report beside it."
    ),
)
def paired_episodes(
    context: dg.AssetExecutionContext, config: PairedEpisodesConfig
) -> dg.MaterializeResult[PairedEpisodes]:
    output_dir = Path(config.output_dir) if config.output_dir else default_workdir()
    try:
        root = task_folder(Path(config.root) if config.root else recordings_root(), context.partition_key)
        manifest = pair_recordings(root, explicit_manifest=config.explicit_manifest, task=config.task)
        path, written = save_manifest(manifest, output_dir)
    except DpflowError as exc:
        raise dg.Failure(
            description=str(exc),
            metadata={"path": exc.path or "", "code": exc.code, "reason": exc.reason},
        ) from exc
    context.log.info(
        f"{len(manifest.accepted)} accepted, {len(manifest.rejected)} rejected -> {path}"
        + ("" if written else " (an equal manifest was already there)")
    )
    value = PairedEpisodes.of(manifest, path)
    metadata = {
        "path": dg.MetadataValue.path(str(path)),
        "manifest_path": dg.MetadataValue.path(str(path)),
        "root": dg.MetadataValue.path(str(manifest.root)),
        "task": manifest.task,
        "accepted": len(manifest.accepted),
        "rejected": len(manifest.rejected),
        "content_hash": manifest.content_hash(),
        "rejects": dg.MetadataValue.md(rejects_table(manifest)),
        "accepted_episodes": dg.MetadataValue.md(accepted_table(manifest)),
    }
    if config.quality and manifest.accepted:
        metadata.update(_quality_metadata(context, config, path, output_dir))
    return dg.MaterializeResult(value=value, metadata=metadata, data_version=dg.DataVersion(manifest.content_hash()))


defs = dg.Definitions(assets=[paired_episodes], jobs=[paired_episodes_job], sensors=[recordings_sensor])
