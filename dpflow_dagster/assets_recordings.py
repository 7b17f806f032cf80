"""Assets of the recordings stage: ``paired_episodes`` (and the sensor and job that request it)."""

import os
from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import Field

from dpflow_core.errors import DpflowError
from dpflow_core.pairing import Manifest, default_recordings_root, pair_recordings, save_manifest
from dpflow_dagster.sensors import paired_episodes_job, recordings_sensor


def default_workdir() -> Path:
    """``$DPFLOW_WORKDIR`` when set, else ``<cwd>/outputs``."""
    env = os.environ.get("DPFLOW_WORKDIR")
    return Path(env) if env else Path.cwd() / "outputs"


class PairedEpisodesConfig(dg.Config):
    """Where the recordings are and where the manifest goes."""

    root: Optional[str] = Field(
        default=None,
        description="Matrix Studio task folder; default $DPFLOW_RECORDINGS_ROOT, else <cwd>/outputs/recordings/pick_place.",
    )
    output_dir: Optional[str] = Field(
        default=None, description="Work folder; the manifest goes to <output_dir>/manifests/. Default $DPFLOW_WORKDIR, else <cwd>/outputs."
    )
    task: Optional[str] = Field(default=None, description="Task name; default from vio_result.json, else the folder name.")
    explicit_manifest: Optional[str] = Field(
        default=None, description='Explicit pairing JSON {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}]}.'
    )


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rejects_table(manifest: Manifest) -> str:
    """Markdown table of the rejects: stem, code, reason."""
    rows = ["| stem | code | reason |", "|---|---|---|"]
    rows += [f"| {_md(r.stem)} | {_md(r.code)} | {_md(r.reason)} |" for r in manifest.rejected]
    return "\n".join(rows) if manifest.rejected else "No rejects."


def accepted_table(manifest: Manifest) -> str:
    """Markdown table of the accepted stems with SHA-256 prefixes and key figures."""
    rows = ["| stem | vio_mcap sha256 | raw_mcap sha256 | overlap s | warnings |", "|---|---|---|---|---|"]
    for a in manifest.accepted:
        warnings = sorted({w["code"] for w in a.validation.get("warnings", [])})
        rows.append(
            f"| {_md(a.stem)} | `{a.files['vio_mcap'].sha256[:12]}` | `{a.files['raw_mcap'].sha256[:12]}` "
            f"| {a.validation.get('overlap_s')} | {_md(', '.join(warnings)) or '-'} |"
        )
    return "\n".join(rows) if manifest.accepted else "No accepted episodes."


@dg.asset(
    group_name="dataset",
    kinds={"mcap"},
    description=(
        "Exact <STEM>.mcap + <STEM>_vio.mcap + <STEM>_vio.json triples of a Matrix Studio task folder: "
        "status success, non-empty, valid MCAP; every other file listed as rejected with a reason. "
        "Writes a content-addressed manifest JSON (files with SHA-256, validation figures)."
    ),
)
def paired_episodes(context: dg.AssetExecutionContext, config: PairedEpisodesConfig) -> dg.Output[dict]:
    root = Path(config.root) if config.root else default_recordings_root()
    output_dir = Path(config.output_dir) if config.output_dir else default_workdir()
    try:
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
    value = {
        "manifest_path": str(path),
        "root": str(manifest.root),
        "task": manifest.task,
        "accepted": len(manifest.accepted),
        "rejected": len(manifest.rejected),
    }
    return dg.Output(
        value,
        metadata={
            "manifest_path": dg.MetadataValue.path(str(path)),
            "root": dg.MetadataValue.path(str(manifest.root)),
            "task": manifest.task,
            "accepted": len(manifest.accepted),
            "rejected": len(manifest.rejected),
            "content_hash": manifest.content_hash(),
            "rejects": dg.MetadataValue.md(rejects_table(manifest)),
            "accepted_episodes": dg.MetadataValue.md(accepted_table(manifest)),
        },
    )


defs = dg.Definitions(assets=[paired_episodes], jobs=[paired_episodes_job], sensors=[recordings_sensor])
