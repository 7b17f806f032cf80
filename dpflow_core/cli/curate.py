"""`dpflow curate`: flag suspect demonstrations with reasons, trim idle stretches, apply a person's labels."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from dpflow_core.cli import app


def _settings(pairs: list[str]):
    """:class:`CurationSettings` with ``NAME=VALUE`` overrides (the fields are the one declaration)."""
    from dpflow_core.curation import CurationSettings

    fields = {f.name: f.type for f in dataclasses.fields(CurationSettings)}
    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise typer.BadParameter(f"--set {pair!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        whole = fields[name] in ("int", int)
        try:
            values[name] = int(value) if whole else float(value)
        except ValueError:
            raise typer.BadParameter(f"--set {pair!r}: {value!r} is not a {'whole ' if whole else ''}number") from None
    try:
        return CurationSettings(**values).validate()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command("curate")
def curate_cmd(
    source: Path = typer.Argument(..., help="A pairing manifest (JSON) or a Matrix Studio task folder (paired first)."),
    output: Path = typer.Option(..., "--output", "-o", help="Curation folder: curation.json, trimmed/, manifests/."),
    labels: Optional[Path] = typer.Option(None, "--labels", help='Labels JSON {"<stem>": "keep"|"drop"|{decision, note, by}}: they overrule dpflow.'),
    set_: list[str] = typer.Option([], "--set", help="A check's limit, NAME=VALUE (CurationSettings field), repeatable."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier curation in the output folder (its trimmed copies the new one does not use are deleted)."),
    as_json: bool = typer.Option(False, "--json", help="Print the curation report as JSON."),
) -> None:
    """Score every accepted episode, flag suspects with reasons, trim idle stretches and write a curated manifest
    (convert it with `dpflow convert`); a labels file's keep/drop overrules each decision and is recorded."""
    from dpflow_core.curation.apply import curate

    from dpflow_core.pairing import manifest_file_for

    settings = _settings(set_)
    result = curate(manifest_file_for(source, output), output, settings, labels, overwrite)
    if as_json:
        typer.echo(json.dumps(json.loads(result.report_path.read_text()), indent=2))
    else:
        typer.echo(result.table())
        typer.echo(f"report: {result.report_path}\ncurated manifest: {result.manifest_path}")
