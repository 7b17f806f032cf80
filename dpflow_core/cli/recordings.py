"""`dpflow` commands of the recordings stage: sample recordings, inspection, pairing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from dpflow_core.cli import app
from dpflow_core.errors import PairingError, RecordingError
from dpflow_core.recordings.topics import DAS_DEFAULT

if TYPE_CHECKING:  # the world's recording stack is imported when a world task is recorded
    from dpflow_core.sim.record import SimRecordingSpec


def _progress() -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@app.command("sample-recordings")
def sample_recordings(
    out: Path = typer.Argument(..., help="Output folder; the task folder OUT/<task> is created in it."),
    episodes: int = typer.Option(6, "--episodes", "-n", min=1, help="Number of episodes."),
    seconds: Optional[float] = typer.Option(None, "--seconds", "-s", min=0.5, help="Random motion: mean episode length in seconds (+-15 %; default 8)."),
    seed: int = typer.Option(0, "--seed", help="Random seed; equal seeds write identical files."),
    task: str = typer.Option("pick_place", "--task", help="Task name (folder name and file stem prefix)."),
    width: Optional[int] = typer.Option(None, "--width", min=16, help="Camera width in pixels (even; default 320 random motion, 128 world)."),
    height: Optional[int] = typer.Option(None, "--height", min=16, help="Camera height in pixels (even; default 240 random motion, 128 world)."),
    motion: str = typer.Option(
        "auto", "--motion",
        help="world: scripted demonstrations of a simulated task (pick_place, stack); random: smooth random "
             "camera motion with no task in it (conversion fixtures); auto: world for the world's tasks.",
    ),
    camera_latency: float = typer.Option(
        0.0, "--camera-latency", help="World recordings: seconds the camera's stamps lag its capture."
    ),
) -> None:
    """Write a Matrix Studio task folder of sample recordings (the demo input and test fixtures)."""
    from rich.console import Console
    from rich.table import Table
    from dpflow_core.names import validate_name
    from dpflow_core.recordings.samples import SampleSpec, write_task
    from dpflow_core.sim.record import SimRecordingSpec
    from dpflow_core.sim.tasks import TASKS

    validate_name(task, "task")
    if motion not in ("auto", "world", "random"):
        raise typer.BadParameter(f"--motion must be auto, world or random, got {motion!r}")
    world = motion == "world" or (motion == "auto" and task in TASKS)
    if motion == "auto" and not world:  # a lab may name its own tasks, but a typo of a world task must show
        typer.echo(f"note: {task!r} is not a world task (the world's tasks: {', '.join(TASKS)}): writing smooth "
                   "random camera motion with no task in it (--motion random); --motion world makes a world "
                   "task's demonstrations", err=True)
    if world and seconds is not None:
        raise typer.BadParameter("--seconds: only for random motion (--motion random); a world demonstration "
                                 "lasts as long as its task takes")
    seconds = seconds or 8.0
    width, height = (width or 128, height or 128) if world else (width or 320, height or 240)
    if width % 2 or height % 2:
        raise RecordingError(f"--width and --height must be even for H.264 (got {width}x{height})")
    if world:
        if task not in TASKS:
            raise typer.BadParameter(f"--motion world: the world's tasks are {list(TASKS)}, got {task!r}")
        _world_recordings(out, task, episodes, seed, SimRecordingSpec(width=width, height=height,
                                                                      camera_latency_s=camera_latency))
        return
    spec = replace(SampleSpec(), width=width, height=height)
    with _progress() as bar:
        job = bar.add_task(f"writing {task}", total=episodes)
        try:
            written = write_task(
                out, episodes=episodes, seconds=seconds, seed=seed, task=task, spec=spec,
                progress=lambda done, total: bar.update(job, completed=done),
            )
        except FileExistsError as exc:
            raise RecordingError(str(exc).split(": ", 1)[-1], Path(out) / task, code="output_exists") from exc
    table = Table(title=f"{Path(out) / task}")
    for col in ("stem", "frames", "poses", "seconds", "_vio.mcap bytes"):
        table.add_column(col, justify="left" if col == "stem" else "right")
    for ep in written:
        span = (int(ep.pose_ts_ns[-1]) - int(ep.pose_ts_ns[0])) / 1e9 if len(ep.pose_ts_ns) else 0.0
        table.add_row(ep.stem, str(len(ep.camera_ts_ns)), str(len(ep.pose_ts_ns)), f"{span:.2f}", f"{ep.vio_mcap.stat().st_size:,}")
    Console().print(table)


def _world_recordings(out: Path, task: str, episodes: int, seed: int, spec: SimRecordingSpec) -> None:
    """Record ``episodes`` world demonstrations of ``task`` with the camera of ``spec`` (a
    :class:`~dpflow_core.sim.record.SimRecordingSpec`) into ``out/<task>``."""
    from rich.console import Console

    from dpflow_core.sim.record import record_task

    with _progress() as bar:
        job = bar.add_task(f"recording {task} in the simulated world", total=episodes)
        try:
            task_dir = record_task(out, task, episodes, seed=seed, spec=spec,
                                   progress=lambda done, total: bar.update(job, completed=done))
        except FileExistsError as exc:
            raise RecordingError(str(exc).split(": ", 1)[-1], Path(out) / task, code="output_exists") from exc
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    Console().print(f"{task_dir}: {episodes} scripted demonstrations of {task} "
                    f"({spec.width}x{spec.height} camera at {spec.fps:g} Hz; seeds in sim_task.json)")


@app.command("inspect-recording")
def inspect_recording_cmd(
    path: Path = typer.Argument(..., help="An MCAP file (<STEM>_vio.mcap, or <STEM>.mcap with --raw)."),
    raw: bool = typer.Option(False, "--raw", help="A raw <STEM>.mcap: the pose topic is not required."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Validate one recording and print its figures; exit 1 when it has errors."""
    from rich.console import Console
    from rich.table import Table
    from dpflow_core.recordings import inspect_recording

    required = (DAS_DEFAULT.camera, DAS_DEFAULT.gripper) if raw else None
    report = inspect_recording(path, DAS_DEFAULT, required=required)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        table = Table(title=str(path))
        for col in ("topic", "messages", "rate Hz", "start offset s", "inversions", "duplicates"):
            table.add_column(col, justify="left" if col == "topic" else "right", overflow="fold")
        for topic, n in sorted(report.message_counts.items()):
            rate = report.rates_hz.get(topic)
            offset = report.start_offsets_s.get(topic)
            table.add_row(
                topic, str(n), "" if rate is None else f"{rate:.2f}", "" if offset is None else f"{offset:.3f}",
                str(report.log_time_inversions.get(topic, "")), str(report.duplicate_timestamps.get(topic, "")),
            )
        console = Console()
        console.print(table)
        console.print(
            f"indexed: {report.indexed}  overlap: {report.overlap_s if report.overlap_s is None else round(report.overlap_s, 3)} s  "
            f"leading undecodable: {report.leading_undecodable_packets} packets  "
            f"pose_valid false: {report.pose_invalid_fraction}"
        )
        for p in report.warnings:
            console.print(f"[yellow]warning[/] {p.code}: {p.reason}")
        for p in report.errors:
            console.print(f"[red]error[/] {p.code}: {p.reason}")
    if report.errors:
        raise typer.Exit(1)


@app.command("pair")
def pair(
    root: Path = typer.Argument(..., help="The Matrix Studio task folder (output/<task_name>)."),
    output: Path = typer.Option(..., "--output", "-o", help="Manifest JSON to write."),
    task: Optional[str] = typer.Option(None, "--task", help="Task name (default: vio_result.json, else folder name)."),
    manifest: Optional[Path] = typer.Option(
        None, "--manifest", help='Explicit pairing {"episodes": [{"stem", "raw_mcap", "vio_mcap", "vio_json"}]}.'
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT when it exists."),
) -> None:
    """Pair <STEM>.mcap + <STEM>_vio.mcap + <STEM>_vio.json by exact stem and write the manifest.

    ROOT may also be a folder holding exactly one task folder (a Matrix Studio output root): that one is paired.
    """
    from rich.console import Console
    from dpflow_core.pairing import PairedEpisodes, pair_recordings, reject_summary, write_manifest
    from dpflow_core.pairing.tasks import resolve_task_folder

    if output.exists() and not overwrite:
        raise PairingError("manifest already exists (pass --overwrite to replace it)", output, code="output_exists")
    if manifest is None and (folder := resolve_task_folder(root)) != root:
        typer.echo(f"{root} holds one task folder: pairing {folder}", err=True)
        root = folder
    with _progress() as bar:
        job = bar.add_task("pairing", total=None)
        result = pair_recordings(
            root, DAS_DEFAULT, explicit_manifest=manifest, task=task,
            progress=lambda stem, done, total: bar.update(job, completed=done, total=total, description=f"pairing {stem}"),
        )
    summary = PairedEpisodes.of(result, write_manifest(result, output, overwrite=overwrite))
    console = Console()
    if result.rejected:
        console.print(stem_table("rejected", [(r.stem, r.code, r.reason) for r in result.rejected], ("code", "reason")))
    console.print(
        f"task {summary.task}: {summary.accepted} accepted, {summary.rejected} rejected -> {summary.manifest_path}"
    )
    if not result.accepted:
        typer.secho(f"error: no episode accepted in {root}; reasons:\n{reject_summary(result.rejected)}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def stem_table(title: str, rows: list[tuple], columns: tuple[str, ...]) -> Table:
    """A rich table whose first column is the stem: stems are never cut with an ellipsis
    (they fold onto the next line), so rows stay distinguishable in an 80-column terminal."""
    from rich.table import Table
    table = Table(title=title)
    table.add_column("stem", overflow="fold", min_width=8)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(str(c) for c in row))
    return table

