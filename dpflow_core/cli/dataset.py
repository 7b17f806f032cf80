"""`dpflow` commands of the dataset stage: conversion to ``dataset.npz`` and norm stats.

``dpflow convert``'s content options are made from :class:`~dpflow_core.conversion.settings.ConversionSettings`
(:func:`dpflow_core.cli.options.settings_options`); only what does not change the dataset (output, workers, backup, cache) is its own.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import typer

from dpflow_core.cli import app, counted, posix_usage
from dpflow_core.cli.options import settings_options
from dpflow_core.conversion.settings import ConversionSettings
from dpflow_core.errors import ConversionError


@app.command("convert")
@settings_options(ConversionSettings)
def convert_cmd(
    inputs: List[Path] = typer.Argument(..., help="Pairing manifest JSON files or Matrix Studio task folders."),
    output: Path = typer.Option(..., "--output", "-o", help="The dataset .npz to create (never overwritten)."),
    workers: int = typer.Option(0, "--workers", "-j", min=0, help="Worker processes (0 = the free cores)."),
    backup: bool = typer.Option(False, "--backup", help="Keep an existing output as <stem>.bak-<time>.npz and replace it."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Align every episode anew; neither read nor fill the cache."),
    mixed_tasks: bool = typer.Option(False, "--mixed-tasks",
                                     help="Accept manifests of different tasks in one dataset (refused by default: "
                                          "a policy learns their mixture); each episode's task is recorded."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    settings: ConversionSettings = None,
) -> None:
    """Convert paired episodes into a dataset.npz replay buffer (+ dataset.json, norm_stats.json).

    Episodes already aligned with the same settings are taken from the per-episode cache
    (`dpflow cache show`); the dataset is byte-identical either way."""
    from dpflow_core.conversion import convert

    with _conversion_progress() as progress:
        result = convert([str(p) for p in inputs], output, settings, workers=workers, backup=backup,
                         progress=progress, cache=not no_cache, mixed_tasks=mixed_tasks)
    _print_conversion(result, as_json)


@contextlib.contextmanager
def _conversion_progress() -> Iterator[Callable[[str, int, int], None]]:
    """The ``progress(stage, done, total)`` of :func:`~dpflow_core.conversion.convert`, drawn as two rich bars
    on stderr while the block runs."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    ) as bar:
        episodes = bar.add_task("aligning episodes", total=None)
        writing = bar.add_task("writing dataset", total=None, visible=False)

        def progress(stage: str, done: int, total: int) -> None:
            if stage == "episodes":
                bar.update(episodes, completed=done, total=total)
            else:
                bar.update(writing, completed=done, total=total, visible=True,
                           description=f"writing dataset ({total / 1e6:.0f} MB)")

        yield progress


def _print_conversion(result, as_json: bool) -> None:
    """Print a :class:`~dpflow_core.conversion.ConversionResult`: as JSON, or its figures, warnings and rejects."""
    from rich.console import Console

    if as_json:
        # the dataset's fields, the rejects and the time; the metadata document is in the sidecar
        typer.echo(json.dumps({k: v for k, v in result.to_dict().items() if k not in ("metadata", "reused")}, indent=2))
        return
    out = Console()
    meta = result.metadata
    lengths = meta["episode_lengths"]
    out.print(f"[bold]{result.path}[/]")
    out.print(f"sha256 {result.sha256}  ({result.size_bytes:,} bytes)")
    out.print(
        f"{counted(result.n_episodes, 'episode')}, {counted(result.total_steps, 'step')} (lengths min {lengths['min']} / mean "
        f"{lengths['mean']:.1f} / max {lengths['max']}), {result.frequency_hz:.3f} Hz, image {result.image_size[0]}x{result.image_size[1]}, "
        f"{result.wall_time_s:.1f} s ({result.frames_per_s:.0f} frames/s)"
    )
    out.print(f"sidecar {result.sidecar_path}\nnorm stats {result.norm_stats_path}")
    cached = meta.get("cache") or {}
    if cached.get("episodes_reused"):
        out.print(f"{counted(cached['episodes_reused'], 'episode')} from the cache {cached['dir']}, "
                  f"{cached['episodes_aligned']} aligned")
    for g in meta.get("rate_groups") or []:
        out.print(f"{counted(g['n_episodes'], 'episode')} at {g['frequency_hz']:.3f} Hz kept as their own dataset {g['path']}")
    for name in meta.get("stale_files_removed") or []:
        out.print(f"removed stale {name} (left by a conversion that is no longer running)")
    for ep in meta["episodes"]:
        for g in (ep.get("long_gaps") or {}).get("gaps", []) if (ep.get("segment") or {}).get("index", 0) == 0 else []:
            out.print(f"{ep['stem']}: camera hole {g['duration_s']:.2f} s after {g['at_s']:.2f} s: {g['action']}")
    for w in meta.get("warnings") or []:
        out.print(f"[yellow]warning[/] {w['code']}: {w['reason']}")
    if result.rejected:
        from dpflow_core.cli.recordings import stem_table

        rows = [(r.get("stem"), r.get("stage"), r.get("code"), r.get("reason")) for r in result.rejected]
        out.print(stem_table(f"{len(result.rejected)} rejected", rows, ("stage", "code", "reason")))


@app.command("norm-stats")
def norm_stats_cmd(
    dataset: Path = typer.Argument(..., help="A dataset.npz replay buffer."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write (default: beside the dataset)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing norm stats file."),
    fmt: str = typer.Option(
        "npz", "--format", help="npz: DATASET is a dataset.npz; openpi: DATASET is a LeRobot v3.0 or v2.1 folder (openpi norm_stats.json)."
    ),
    action_horizon: int = typer.Option(50, "--action-horizon", help="openpi only: model.action_horizon (pi0: 50)."),
    batch_size: int = typer.Option(32, "--batch-size", help="openpi only: batch_size (32); partial batches dropped as openpi does."),
    delta_actions: Optional[str] = typer.Option(
        None, "--delta-actions", help="openpi only: DeltaActions mask as make_bool_mask counts, e.g. 6,-1."
    ),
) -> None:
    """Compute per-key mean/std/min/max/q01/q99 of a dataset's low-dimensional members."""
    from rich.console import Console
    from rich.table import Table
    if fmt == "openpi":
        from dpflow_core.cli.lerobot import write_openpi

        write_openpi(dataset, output, overwrite, None, action_horizon, batch_size, delta_actions)
        return
    if fmt != "npz":
        raise ConversionError(f"--format must be npz or openpi, got {fmt!r}", code="bad_option")
    from dpflow_core.conversion import norm_stats_path_for
    from dpflow_core.dataset import compute_norm_stats, write_norm_stats

    stats = compute_norm_stats(dataset)
    path = write_norm_stats(stats, output or norm_stats_path_for(dataset), overwrite=overwrite)
    table = Table(title=f"{path} (dataset sha256 {stats['dataset']['sha256'][:12]}...)")
    for col in ("key", "dim", "mean", "std", "min", "max", "q01", "q99"):
        table.add_column(col, justify="left" if col == "key" else "right", no_wrap=True)
    for key, s in stats["norm_stats"].items():
        for d in range(len(s["mean"])):
            table.add_row(key if d == 0 else "", str(d), *(f"{s[f][d]:.4g}" for f in ("mean", "std", "min", "max", "q01", "q99")))
    print_wide(table)


def print_wide(table) -> None:
    """Print a rich table; into a pipe or file (no terminal width to respect) at its full width, never cut."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, Measurement.get(console, console.options.update_width(1000), table).maximum)
    console.print(table)


@app.command("export-umi")
def export_umi_cmd(
    source: Path = typer.Argument(..., help="A dataset.npz, or a pairing manifest JSON (converted first, to a temporary npz)."),
    output: Path = typer.Option(..., "--output", "-o", help="The dataset.zarr.zip to create (<name>.zarr.zip.json beside it)."),
    image_size: str = typer.Option("224,224", "--image-size", help="Frame size W,H when SOURCE is a manifest."),
    level: int = typer.Option(80, "--jpegxl-level", min=0, max=100, help="JPEG-XL quality of the frames (0-100)."),
    effort: int = typer.Option(3, "--jpegxl-effort", min=1, max=9, help="JPEG-XL encoder effort (1 fast .. 9 small)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write the replay buffer as upstream UMI's zarr (format 2) dataset.zarr.zip, SHA-256 in its sidecar."""
    import tempfile

    from dpflow_core.export.umi import export_umi

    if source.suffix == ".npz":
        result = export_umi(source, output, jpegxl_level=level, jpegxl_effort=effort, overwrite=overwrite)
    else:
        from dpflow_core.conversion import convert

        with tempfile.TemporaryDirectory(prefix=".dpflow-umi-", dir=output.parent if output.parent.exists() else None) as tmp:
            npz = Path(tmp) / "dataset.npz"
            convert([str(source)], npz, ConversionSettings(image_size=image_size))
            result = export_umi(npz, output, jpegxl_level=level, jpegxl_effort=effort, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    typer.echo(f"{result.path}: {result.n_episodes} episodes, {result.n_steps} steps, frames "
               f"{result.image_shape} JPEG-XL level {result.jpegxl_level}; sha256 {result.sha256} "
               f"({result.size_bytes} bytes) in {result.sidecar_path}")


cache_app = posix_usage(typer.Typer(
    help="The per-episode conversion cache (aligned, resized arrays by content address) that convert and the "
         "dataset_npz asset share: show it, prune it to a size.",
    no_args_is_help=True,
))
app.add_typer(cache_app, name="cache")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@cache_app.command("show")
def cache_show_cmd(as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON.")) -> None:
    """Where the cache is ($DPFLOW_CACHE_DIR), its entries, size and limit ($DPFLOW_CACHE_MAX_BYTES)."""
    from dpflow_core.episode_cache import EpisodeCache

    cache = EpisodeCache()
    entries = cache.entries()
    doc = {
        "dir": str(cache.root),
        "entries": len(entries),
        "size_bytes": sum(e.size_bytes for e in entries),
        "max_bytes": cache.max_bytes,
        "oldest_use": min((e.last_used for e in entries), default=None),
        "newest_use": max((e.last_used for e in entries), default=None),
    }
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    typer.echo(f"{doc['dir']}: {doc['entries']} episodes, {_human(doc['size_bytes'])} of {_human(doc['max_bytes'])}")


@cache_app.command("prune")
def cache_prune_cmd(
    max_size: Optional[str] = typer.Option(
        None, "--max-size", help="Keep at most this much (bytes or 500M, 20G; 0 empties it). Default: the limit."
    ),
) -> None:
    """Remove the least recently used episodes until the cache fits the size."""
    from dpflow_core.episode_cache import EpisodeCache, parse_size

    cache = EpisodeCache()
    limit = parse_size(max_size, "--max-size") if max_size is not None else cache.max_bytes
    removed = cache.prune(limit)
    left = sum(e.size_bytes for e in cache.entries())
    typer.echo(f"removed {len(removed)} entries ({_human(sum(e.size_bytes for e in removed))}); "
               f"{_human(left)} left in {cache.root}")
