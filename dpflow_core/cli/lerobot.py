"""`dpflow` commands of the LeRobot export: ``export-lerobot`` and ``lerobot-norm-stats``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dpflow_core import export as lerobot
from dpflow_core.cli import app


@app.command("export-lerobot")
def export_lerobot_cmd(
    manifest: Path = typer.Argument(..., help="Pairing manifest (JSON) of the accepted episodes."),
    output: Path = typer.Option(..., "-o", "--output", help="Dataset folder to create (must not exist)."),
    task_text: str = typer.Option(None, "--task-text", help="Task text of every episode [default: the task folder name]."),
    action_rule: str = typer.Option("next_state", "--action-rule", help="next_state | delta"),
    image_size: str = typer.Option("native", "--image-size", help="W,H (even numbers) or native."),
    invalid_pose_policy: str = typer.Option("trim", "--invalid-pose-policy", help="trim | reject"),
    frequency_tolerance: float = typer.Option(0.05, "--frequency-tolerance", help="Relative; episodes off the median rate are left out."),
    workers: int = typer.Option(0, "--workers", help="Alignment worker processes [default: 0 = CPU cores]."),
) -> None:
    """Write a LeRobot v2.1 dataset (parquet + H.264 MP4 + meta/) from paired recordings."""
    result = lerobot.export_lerobot(
        manifest,
        output,
        task_text=task_text,
        action_rule=action_rule,
        image_size=lerobot.parse_image_size(image_size),
        invalid_pose_policy=invalid_pose_policy,
        frequency_tolerance=frequency_tolerance,
        workers=workers,
    )
    typer.echo(
        f"{result.path}: {result.n_episodes} episodes, {result.total_frames} frames, "
        f"fps {result.fps:.4f}, {result.image_size[0]}x{result.image_size[1]}, actions {result.action_rule}, "
        f"task {result.task!r}"
    )
    for stem, reason in result.skipped.items():
        typer.echo(f"skipped {stem}: {reason}", err=True)


@app.command("lerobot-norm-stats")
def lerobot_norm_stats_cmd(
    dataset: Path = typer.Argument(..., help="LeRobot dataset folder (holding meta/info.json)."),
    output: Path = typer.Option(None, "-o", "--output", help="File or folder [default: DATASET/norm_stats.json]."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing norm_stats.json."),
    codebase_version: Optional[str] = typer.Option(
        None, "--codebase-version", help="Required codebase_version (default: the one dpflow writes, v2.1)."
    ),
) -> None:
    """openpi norm_stats.json (mean, std, q01, q99 of state and actions) from the parquet columns only."""
    path = lerobot.write_openpi_norm_stats(dataset, output, overwrite=overwrite,
                                           expected_version=codebase_version or lerobot.CODEBASE_VERSION)
    typer.echo(str(path))
