"""`dpflow clean`: the temporaries a killed run left in a folder, listed and removed.

The same function (:func:`dpflow_core.files.remove_stale_temporaries`) that conversion, export, the report and
pairing call on their own output folders; a live run's temporaries (its PID alive with the start time recorded
in the name) are never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dpflow_core.cli import app
from dpflow_core.errors import DpflowError


@app.command("clean")
def clean_cmd(
    folder: Path = typer.Argument(..., help="The folder to clean, with its sub-folders (a work folder, an output folder)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed; remove nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print what was removed as JSON."),
) -> None:
    """Remove the temporaries (``.<name>.tmp-/partial-/work-<pid>-s<start>``) of runs that no longer run."""
    from dpflow_core.files import display_name, remove_stale_temporaries

    if not folder.is_dir():
        raise DpflowError("not a folder", folder, code="not_a_folder")
    removed = remove_stale_temporaries(folder, recursive=True, dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps({"folder": display_name(folder), "dry_run": dry_run, "removed": [
            {"path": display_name(t.path), "kind": t.kind, "pid": t.pid, "start_time": t.start_time} for t in removed]}))
        return
    verb = "would remove" if dry_run else "removed"
    for t in removed:
        typer.echo(f"{verb} {display_name(t.path)} (left by process {t.pid}, no longer running)")
    typer.echo(f"{verb} {len(removed)} stale temporar{'y' if len(removed) == 1 else 'ies'} under {display_name(folder)}")
