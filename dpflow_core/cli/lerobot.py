"""`dpflow` commands of the LeRobot export: ``export-lerobot`` and ``lerobot-norm-stats``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dpflow_core import export as lerobot
from dpflow_core.cli import app
from dpflow_core.cli.options import settings_options
from dpflow_core.errors import DatasetError
from dpflow_core.export import OPENPI_ACTION_HORIZON, OPENPI_BATCH_SIZE
from dpflow_core.export.settings import ExportSettings


@app.command("export-lerobot")
@settings_options(ExportSettings)
def export_lerobot_cmd(
    manifest: Path = typer.Argument(..., help="Pairing manifest (JSON) of the accepted episodes."),
    output: Path = typer.Option(..., "-o", "--output", help="Dataset folder to create (must not exist)."),
    workers: int = typer.Option(0, "--workers", help="Alignment worker processes (0: one per CPU core)."),
    settings: ExportSettings = None,
) -> None:
    """Write a LeRobot dataset, v3.0 or v2.1 (parquet + H.264 MP4 + meta/), from paired recordings."""
    result = lerobot.export_lerobot(manifest, output, settings, workers=workers)
    typer.echo(
        f"{result.path}: LeRobot {result.codebase_version}, {result.n_episodes} episodes, {result.total_frames} frames, "
        f"fps {result.fps:.4f}, {result.image_size[0]}x{result.image_size[1]}, actions {result.action_rule}, "
        f"task {result.task!r}"
    )
    for stem in result.resampled:
        typer.echo(f"resampled {stem} to {result.fps:.4f} Hz (images held, poses interpolated)", err=True)
    for g in result.rate_groups:
        typer.echo(f"{g['n_episodes']} episodes at {g['fps']:.3f} Hz kept as their own dataset {g['path']}")
    for stem, reason in result.skipped.items():
        typer.echo(f"skipped {stem}: {reason}", err=True)


def parse_delta_mask(value: str | None) -> list[bool] | None:
    """``--delta-actions``: None/"" -> no transform; ``"6,-1"`` -> openpi's ``make_bool_mask(6, -1)``
    (6 true, then 1 false); ``"1,1,0"`` style 0/1 lists are not accepted (ambiguous with counts).

    Raises:
        DatasetError: on anything but comma-separated non-zero integers.
    """
    if not value:
        return None
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError as exc:
        raise DatasetError(f"--delta-actions must be counts like 6,-1 (openpi's make_bool_mask), got {value!r}",
                           code="bad_option") from exc
    if not counts or 0 in counts:
        raise DatasetError(f"--delta-actions counts must be non-zero, got {value!r}", code="bad_option")
    return [c > 0 for c in counts for _ in range(abs(c))]


def write_openpi(dataset: Path, output: Path | None, overwrite: bool, codebase_version: str | None,
                 action_horizon: int, batch_size: int, delta_actions: str | None) -> None:
    """The openpi norm stats of both commands (``norm-stats --format openpi`` and ``lerobot-norm-stats``)."""
    path = lerobot.write_openpi_norm_stats(
        dataset, output, overwrite=overwrite, expected_version=codebase_version,
        action_horizon=action_horizon, batch_size=batch_size, delta_action_mask=parse_delta_mask(delta_actions),
    )
    typer.echo(str(path))


ACTION_HORIZON_OPTION = typer.Option(OPENPI_ACTION_HORIZON, "--action-horizon",
                                     help="openpi's model.action_horizon (pi0: 50): action chunk length.")
BATCH_SIZE_OPTION = typer.Option(OPENPI_BATCH_SIZE, "--batch-size",
                                 help="openpi's batch_size (32); the last partial batch is dropped as openpi does.")
DELTA_OPTION = typer.Option(None, "--delta-actions",
                            help="openpi's DeltaActions mask as make_bool_mask counts, e.g. 6,-1 (pose relative, gripper absolute).")


@app.command("lerobot-norm-stats")
def lerobot_norm_stats_cmd(
    dataset: Path = typer.Argument(..., help="LeRobot dataset folder (holding meta/info.json)."),
    output: Path = typer.Option(None, "-o", "--output", help="File or folder (default: DATASET/norm_stats.json)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing norm_stats.json."),
    codebase_version: str = typer.Option(None, "--codebase-version", help="Required codebase_version (default: v3.0 or v2.1)."),
    action_horizon: int = ACTION_HORIZON_OPTION,
    batch_size: int = BATCH_SIZE_OPTION,
    delta_actions: str = DELTA_OPTION,
) -> None:
    """openpi norm_stats.json (mean, std, q01, q99 of state and actions, as openpi computes them) from the parquet columns only."""
    write_openpi(dataset, output, overwrite, codebase_version, action_horizon, batch_size, delta_actions)
